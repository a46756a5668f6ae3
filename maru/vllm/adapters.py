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

Invariants: an adapter is keyed only from files this process read (a path it cannot read as a
directory is a ``Skipped`` request, never a key by name); ``lora_path`` resolves as vLLM resolves
it, except that a Hugging Face id resolves only to this host's cached snapshot (Maru never
downloads: until vLLM's worker has, the id's requests are left to vLLM quietly); a digest is worked out again when a
file's size or modification time changed (an adapter rewritten in place), and otherwise read
once per adapter directory; the digest covers every file under the directory, their relative
paths included, and the engine's LoRA compute settings (``lora_dtype``).
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
    "prompts given as embeddings are computed by vLLM itself, not loaded nor stored: Maru keys KV "
    "by token ids, which such a prompt has not. Fix: none needed; send token ids or text to share"
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
ADAPTER_CHANGING = Skipped(
    "the LoRA adapter's files changed while Maru read them: this request is computed by vLLM, the "
    "next one reads them again",
    announce=False,
)
PENDING_S = 300.0  # how long a Hugging Face id may stay undownloaded before it is announced
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


def _listing(path: str) -> tuple[tuple[str, int, int], ...]:
    """Every regular file under ``path`` as (relative path, size, mtime_ns), sorted: what must be
    unchanged for a digest to stand. Raises OSError where ``path`` is not a readable directory."""
    out: list[tuple[str, int, int]] = []
    for top, dirs, files in os.walk(path, onerror=_raise):
        dirs.sort()
        for name in files:
            full = os.path.join(top, name)
            st = os.stat(full)
            out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
    out.sort()
    return tuple(out)


def _raise(e: OSError) -> None:
    raise e


class AdapterDigests:
    """LoRA adapters keyed by their files (see the module). ``compute``: the engine's LoRA settings
    that change what an adapter computes (vLLM's ``lora_dtype``), mixed into every digest."""

    def __init__(self, compute: str = "") -> None:
        self._compute = compute.encode()
        # resolved directory -> (listing the digest was made from, digest)
        self._known: dict[str, tuple[tuple[tuple[str, int, int], ...], bytes]] = {}
        self._unreadable: set[str] = set()  # paths announced unreadable (once each)
        self._pending: dict[str, float] = {}  # Hugging Face ids not cached yet: first seen (monotonic)
        self._said_pending: set[str] = set()
        self._resolved: dict[str, tuple[float, str]] = {}  # lora_path -> (when, directory)
        self.hashed_bytes = 0  # bytes read to make digests (``maru stats``: adapter_bytes_hashed)

    def digest(self, lora_request: Any) -> bytes | Skipped:
        """The digest of the request's adapter, ``ADAPTER_PENDING`` for a Hugging Face id vLLM has
        not downloaded yet (for ``PENDING_S``), else ``ADAPTER_UNREADABLE``."""
        given = str(getattr(lora_request, "lora_path", "") or "")
        name = getattr(lora_request, "lora_name", "?")
        try:
            if getattr(lora_request, "tensorizer_config_dict", None):
                raise NotADirectoryError("tensorizer weights (not a directory of files)")
            if not given:
                raise NotADirectoryError("no lora_path")
            path = self._resolve(given)
            listing = _listing(path)
            known = self._known.get(path)
            if known is not None and known[0] == listing:
                return known[1]
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
        self._known[path] = (listing, d)
        logger.info(
            "Maru: LoRA adapter %r keyed by its files (%s, %d files, %.1f MB read in %.0f ms)%s",
            name,
            path,
            len(listing),
            size / 1e6,
            (time.perf_counter() - t0) * 1e3,
            ", changed since last keyed" if known is not None else "",
        )
        return d

    def _resolve(self, given: str) -> str:
        """``resolve``, remembered for ``RESOLVE_S`` (a Hugging Face id costs ~180 us to resolve
        on the CI machine, on vLLM's scheduling thread; a directory's files are listed anyway)."""
        now = time.monotonic()
        hit = self._resolved.get(given)
        if hit is not None and now - hit[0] < RESOLVE_S:
            return hit[1]
        path = resolve(given)
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
        if getattr(request, "prompt_token_ids", None) is None:
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
