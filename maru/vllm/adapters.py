"""What a request's KV depends on beyond its tokens and the engine: its ``RequestScope``.

Two requests with the same tokens share KV only when they ran the same weights under the same
isolation. The engine's weights are in the key space (``KeySpace``); per request, vLLM adds:

- ``cache_salt``: isolation by the caller's choice (tenants). Keyed as given.
- a LoRA adapter (``lora_request``): other weights, so other KV in every layer after the first
  adapted projection. vLLM's own prefix cache names an adapter by ``lora_name`` and ``lora_path``,
  which is enough inside one engine; across engines and hosts a name says nothing of the weights
  (another host's ``adapter-x`` may be another training run). Maru keys an adapter by the digest
  of its files (``AdapterDigests``): the same files under any name or path share, other files never.
- multimodal inputs (``mm_features``): each by vLLM's hash of its content (``identifier``) and its
  placeholder tokens' place (``MediaItem``), mixed into the chunks they overlap.
- prompt embeddings, and multimodal inputs without an identifier: not covered by Maru's keys, so
  such requests are left to vLLM (``RequestScope`` is then a ``Skipped`` note, announced once and
  reported: ``maru doctor``).

Invariants: an adapter is keyed only from the files vLLM loads of it (``ADAPTER_FILES``), read by
this process (a path it cannot read as an adapter directory is a ``Skipped`` request, never a key by
name); ``lora_path`` resolves as vLLM resolves it, except that a Hugging Face id resolves only to
this host's cached snapshot (Maru never downloads: until vLLM's worker has, the id's requests are
left to vLLM quietly); the digest is made at the adapter's first request and covers the files'
names, sizes and bytes and the engine's LoRA compute settings (``lora_dtype``); it stands while
the files stay as they were (listed at each request and each second while it has live ones); once
they change, the adapter is never keyed again in this engine (``ADAPTER_CHANGED``: vLLM may run
either version) and its live requests stop loading and storing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from maru.vllm.keys import MediaItem

logger = logging.getLogger("maru.vllm")

_READ = 1 << 20  # bytes read at a time while hashing an adapter's files


@dataclass(frozen=True)
class RequestScope:
    """The part of a request's key beyond its tokens: its salt and its adapter's digest (None:
    none). The default scope keys as every request did before scopes existed."""

    salt: str | None = None
    adapter: bytes | None = None
    media: tuple[MediaItem, ...] = ()


@dataclass(frozen=True)
class Skipped:
    """A request Maru's keys cannot cover: ``note`` says which kind, why, and what to do.
    ``announce``: warned once and reported for ``maru doctor``; False for a state that passes by
    itself (an adapter vLLM has not downloaded yet), logged once at INFO instead."""

    note: str
    announce: bool = True


EMBEDDINGS = Skipped(
    "prompts given as embeddings (whole or in part) are computed by vLLM itself, not loaded nor "
    "stored: Maru keys KV by token ids, which do not describe an embedding. Fix: none needed; "
    "send token ids or text to share"
)
MULTIMODAL = Skipped(
    "multimodal requests whose inputs vLLM gave no identifier (hash) are computed by vLLM itself, "
    "not loaded nor stored: one text with another image has other KV, and Maru keys an input by "
    "vLLM's identifier. Fix: a vLLM that hashes multimodal inputs (its default; >= 0.10)"
)
ADAPTER_UNREADABLE = Skipped(
    "LoRA requests whose adapter this process cannot read as a directory (a resolver's name, "
    "tensorizer weights, no permission, a Hugging Face id missing from this host's cache) are "
    "computed by vLLM itself: Maru keys an adapter by the digest of its files and never by its name. "
    "Fix: give lora_path as a local directory (or a Hugging Face id vLLM downloads into this host's "
    "cache) readable by vLLM's scheduler process; the log names the adapter"
)
ADAPTER_PENDING = Skipped(
    "the LoRA adapter is not in this host's Hugging Face cache yet (vLLM downloads it for its first "
    "request): its requests are computed by vLLM until it is",
    announce=False,
)
ADAPTER_CHANGED = Skipped(
    "LoRA requests of an adapter whose files changed on disk after Maru keyed them are computed by "
    "vLLM itself: vLLM keeps the weights it loaded (it reloads on eviction or load_inplace), so Maru "
    "cannot tell which version computes. Fix: serve each new version under a new lora_name and "
    "lora_int_id (or restart the engine); the log names the adapter"
)
ADAPTER_CHANGING = Skipped(
    "the LoRA adapter's files changed while Maru read them: this request is computed by vLLM, the "
    "next one reads them again",
    announce=False,
)
PENDING_S = 300.0  # how long a Hugging Face id may stay undownloaded before it is announced
RECHECK_S = 1.0  # how often the files of an adapter with live requests are listed (each step at most)
RESOLVE_S = 5.0  # how long a lora_path's directory is remembered (a new download is seen after it)


def resolve(lora_path: str) -> str:
    """The directory vLLM loads ``lora_path`` from, as vLLM resolves it (an absolute or ``~`` path,
    a relative one that exists, else a Hugging Face id), but never downloading: a Hugging Face id
    resolves only to this host's cached snapshot. Raises ``FileNotFoundError`` for an id not
    cached (yet); ``NotADirectoryError`` for a path that is not a directory."""
    if os.path.isabs(lora_path):
        path = lora_path
    elif lora_path.startswith("~"):
        path = os.path.expanduser(lora_path)
    elif os.path.exists(lora_path):
        path = os.path.abspath(lora_path)
    else:
        path = _cached_snapshot(lora_path)
    if not os.path.isdir(path):
        raise NotADirectoryError(f"not a directory: {path}")
    return path


def _cached_snapshot(repo_id: str) -> str:
    if os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        raise NotADirectoryError(f"{repo_id!r}: a ModelScope id (Maru reads Hugging Face's cache only)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - vLLM depends on it
        raise NotADirectoryError(f"{repo_id!r}: huggingface_hub is not installed") from e
    try:
        return str(snapshot_download(repo_id=repo_id, local_files_only=True))
    except Exception as e:  # not cached (LocalEntryNotFoundError), not a valid id, ...
        raise FileNotFoundError(
            f"{repo_id!r} is not in this host's Hugging Face cache ({type(e).__name__})"
        ) from e


# The files vLLM reads of an adapter directory (``vllm.lora``: the config and one weights file).
ADAPTER_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_model.pt",
    "new_embeddings.safetensors",
    "new_embeddings.bin",
)


def _listing(path: str) -> tuple[tuple[str, int, int], ...]:
    """The files vLLM reads under ``path`` (``ADAPTER_FILES`` that exist) as (name, size,
    mtime_ns): what must be unchanged for a digest to stand. Raises OSError where ``path`` holds
    no adapter config (vLLM could not load it either)."""
    out: list[tuple[str, int, int]] = []
    for name in ADAPTER_FILES:
        try:
            st = os.stat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    if not out or out[0][0] != "adapter_config.json":
        raise FileNotFoundError(f"no adapter_config.json in {path}")
    return tuple(out)


@dataclass
class _Pinned:
    """An adapter as keyed at its first request: where its files are, as they were, their digest."""

    path: str
    listing: tuple[tuple[str, int, int], ...]
    digest: bytes
    checked: float  # monotonic time of the last listing that matched


class AdapterDigests:
    """LoRA adapters keyed by their files (see the module). ``compute``: the engine's LoRA settings
    that change what an adapter computes (vLLM's ``lora_dtype``), mixed into every digest.

    An adapter's digest is made at its first request and kept for the engine's life, as vLLM's
    worker keeps the weights it loaded then (per ``lora_int_id``). Files that change later (a new
    training step written in place, another snapshot behind a Hugging Face id) make it
    ``ADAPTER_CHANGED`` for good: vLLM may run either version (it reloads only on eviction or
    ``load_inplace``), so neither can be vouched for; ``changed`` hands the scheduler the digest
    once, to stop its live requests."""

    def __init__(self, compute: str = "") -> None:
        self._compute = compute.encode()
        self._pinned: dict[tuple[int, str], _Pinned] = {}  # (lora_int_id, lora_path) -> first keying
        self._changed: set[tuple[int, str]] = set()  # adapters never keyed again
        self._new_changes: list[bytes] = []  # digests changed since the scheduler last took them
        self._unreadable: set[str] = set()  # paths announced unreadable (once each)
        self._pending: dict[str, float] = {}  # Hugging Face ids not cached yet: first seen (monotonic)
        self._said_pending: set[str] = set()
        self._resolved: dict[
            str, tuple[float, str | OSError]
        ] = {}  # lora_path -> (when, directory or why not)
        self.hashed_bytes = 0  # bytes read to make digests (``maru stats``: adapter_bytes_hashed)

    @property
    def pinned(self) -> bool:
        """Whether any adapter was keyed (the scheduler then watches their files each second)."""
        return bool(self._pinned)

    def take_changed(self) -> list[bytes]:
        """The digests of adapters found changed since the last call (each handed over once)."""
        out, self._new_changes = self._new_changes, []
        return out

    def digest(self, lora_request: Any) -> bytes | Skipped:
        """The digest of the request's adapter; ``ADAPTER_PENDING`` for a Hugging Face id vLLM has
        not downloaded yet (for ``PENDING_S``), ``ADAPTER_CHANGED`` once its files changed, else
        ``ADAPTER_UNREADABLE``."""
        given = str(getattr(lora_request, "lora_path", "") or "")
        name = str(getattr(lora_request, "lora_name", "?"))
        ident = (int(getattr(lora_request, "lora_int_id", 0) or 0), given)
        if ident in self._changed:
            return ADAPTER_CHANGED
        pinned = self._pinned.get(ident)
        try:
            if type(lora_request).__name__ != "LoRARequest":
                # A subclass may bring its weights some other way (tensors in memory): not its files.
                raise NotADirectoryError(f"a {type(lora_request).__name__}, not vLLM's LoRARequest")
            if getattr(lora_request, "tensorizer_config_dict", None):
                raise NotADirectoryError("tensorizer weights (not a directory of files)")
            if not given:
                raise NotADirectoryError("no lora_path")
            if pinned is not None:
                return self._still(ident, pinned, name)
            path = self._resolve(given)
            listing = _listing(path)
            t0 = time.perf_counter()
            d, size = self._hash(path, listing)
        except BlockingIOError as e:  # written while read: passes by itself, the next request reads again
            logger.info("Maru: LoRA adapter %r left to vLLM for this request: %s", name, e)
            return ADAPTER_CHANGING
        except FileNotFoundError as e:  # a Hugging Face id vLLM has not downloaded yet
            first = self._pending.setdefault(given, time.monotonic())
            if time.monotonic() - first < PENDING_S:
                if given not in self._said_pending:
                    self._said_pending.add(given)
                    logger.info("Maru: LoRA adapter %r: %s; left to vLLM until it is", name, e)
                return ADAPTER_PENDING
            return self._unreadable_now(given, name, e)
        except OSError as e:
            return self._unreadable_now(given, name, e)
        self._pending.pop(given, None)
        self._unreadable.discard(given)
        self._pinned[ident] = _Pinned(path, listing, d, time.monotonic())
        logger.info(
            "Maru: LoRA adapter %r keyed by its files (%s, %d files, %.1f MB read in %.0f ms)",
            name,
            path,
            len(listing),
            size / 1e6,
            (time.perf_counter() - t0) * 1e3,
        )
        return d

    def recheck(self, digests: set[bytes], every_s: float | None = None) -> None:
        """List the files of the keyed adapters whose digest is in ``digests`` (those of live
        requests), each at most every ``every_s`` (``RECHECK_S``): a change found is handed out by
        ``take_changed``."""
        every_s = RECHECK_S if every_s is None else every_s
        for ident, pinned in list(self._pinned.items()):
            if pinned.digest in digests:
                self._still(ident, pinned, ident[1], every_s)

    def _still(
        self, ident: tuple[int, str], pinned: _Pinned, name: str, every_s: float = 0.0
    ) -> bytes | Skipped:
        """``pinned.digest`` if the adapter's files are as they were keyed (or were listed less
        than ``every_s`` ago), else ``ADAPTER_CHANGED`` (announced, handed to ``take_changed``)."""
        now = time.monotonic()
        if every_s and now - pinned.checked < every_s:
            return pinned.digest
        try:
            path = self._resolve(ident[1])
            same = path == pinned.path and _listing(path) == pinned.listing
        except OSError as e:
            same, why = False, f"{type(e).__name__}: {e}"
        else:
            why = "another snapshot" if path != pinned.path else "their sizes or modification times"
        if same:
            pinned.checked = now
            return pinned.digest
        del self._pinned[ident]
        self._changed.add(ident)
        self._new_changes.append(pinned.digest)
        logger.warning(
            "Maru: LoRA adapter %r (lora_path=%r, lora_int_id=%d): its files changed after Maru keyed them "
            "(%s); vLLM may run either version, so its requests are computed by vLLM from now on. "
            "Fix: serve a new version under a new lora_name and lora_int_id (or restart the engine)",
            name,
            ident[1],
            ident[0],
            why,
        )
        return ADAPTER_CHANGED

    def _resolve(self, given: str) -> str:
        """``resolve``, remembered for ``RESOLVE_S`` (a Hugging Face id costs ~180 us to resolve
        on the CI machine, on vLLM's scheduling thread; a directory's files are listed anyway)."""
        now = time.monotonic()
        hit = self._resolved.get(given)
        if hit is not None and now - hit[0] < RESOLVE_S:
            if isinstance(hit[1], OSError):  # not resolvable a moment ago: a waiting request asks each step
                raise hit[1]
            return hit[1]
        try:
            path = resolve(given)
        except OSError as e:
            self._resolved[given] = (now, e)
            raise
        self._resolved[given] = (now, path)
        return path

    def _unreadable_now(self, given: str, name: str, e: OSError) -> Skipped:
        if given not in self._unreadable:
            self._unreadable.add(given)
            logger.warning("Maru: LoRA adapter %r (lora_path=%r) is left to vLLM: %s", name, given, e)
        return ADAPTER_UNREADABLE

    def _hash(self, path: str, listing: tuple[tuple[str, int, int], ...]) -> tuple[bytes, int]:
        h = hashlib.blake2b(b"lora-adapter/1", digest_size=32)
        h.update(self._compute)
        total = 0
        for rel, size, _ in listing:
            h.update(b"\0" + rel.encode() + b"\0" + size.to_bytes(8, "little"))
            with open(os.path.join(path, rel), "rb") as f:
                while piece := f.read(_READ):
                    h.update(piece)
                    total += len(piece)
        after = _listing(path)
        if after != listing:  # written while read: a digest of neither version
            raise BlockingIOError(f"the adapter's files changed while they were read ({path})")
        self.hashed_bytes += total
        return h.digest(), total


def lora_compute(vllm_config: Any) -> str:
    """The engine's LoRA settings that change an adapter's numbers: its ``lora_dtype`` unless
    "auto" (then the model's dtype, which the key space holds). "" without LoRA."""
    lc = getattr(vllm_config, "lora_config", None)
    dtype = getattr(lc, "lora_dtype", None) if lc is not None else None
    if dtype is None or str(dtype) == "auto":
        return ""
    return f"lora_dtype={str(dtype).removeprefix('torch.')}"


class RequestScopes:
    """Each request's ``RequestScope``, or the ``Skipped`` note of one Maru leaves to vLLM."""

    def __init__(self, adapters: AdapterDigests | None = None) -> None:
        self.adapters = adapters if adapters is not None else AdapterDigests()

    def of(self, request: Any) -> RequestScope | Skipped:
        # Embeddings alone, or mixed with tokens (a placeholder id where each embedding goes).
        if (
            getattr(request, "prompt_token_ids", None) is None
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return EMBEDDINGS
        media: tuple[MediaItem, ...] = ()
        if features := getattr(request, "mm_features", None):
            items = media_items(features)
            if items is None:
                return MULTIMODAL
            media = items
        salt = getattr(request, "cache_salt", None) or None
        lora = getattr(request, "lora_request", None)
        if lora is None:
            return RequestScope(salt=salt, media=media)
        adapter = self.adapters.digest(lora)
        if isinstance(adapter, Skipped):
            return adapter
        return RequestScope(salt=salt, adapter=adapter, media=media)


def media_items(features: Any) -> tuple[MediaItem, ...] | None:
    """vLLM's ``mm_features`` as ``MediaItem``s in prompt order; None where one has no identifier
    or no place (the request cannot be keyed)."""
    out: list[MediaItem] = []
    for f in features:
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        if not ident or pos is None:
            return None
        try:
            item = MediaItem(
                int(pos.offset), int(pos.length), str(ident), str(getattr(f, "modality", "") or "")
            )
        except (TypeError, ValueError, AttributeError):
            return None
        if item.offset < 0 or item.length <= 0:
            return None
        out.append(item)
    return tuple(sorted(out, key=lambda m: m.offset))
