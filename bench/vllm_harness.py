"""Pieces of the real-vLLM benchmark and GPU end-to-end tests: a generated model, engines in child processes.

Self-contained on purpose (it uses Maru only through vLLM's kv-transfer config and the
connector's ``maru_stats()``), so it keeps working while Maru's packages move around:

- ``ModelSpec`` / ``make_model``: a Llama model with random weights and a word-level tokenizer
  built locally (no downloads). ``GPU_MODEL`` has Llama-3-8B's KV geometry (32 layers, 8 KV
  heads of 128, bf16; hidden 4096, intermediate 4096: about 3B parameters); ``TINY_MODEL`` is
  small enough for vLLM's CPU build on two cores.
- ``Engine``: one ``vllm.LLM`` in its own process (``python bench/vllm_harness.py --child``,
  in-process engine mode inside), driven by JSON lines. Several can be started at once (their
  start-up overlaps) and driven one after the other.
- ``ApiServer``: ``python -m vllm.entrypoints.openai.api_server`` in its own process group, and
  ``stream_ttft``, one streaming completion timed to its first token.
- ``same_greedy``: greedy outputs compared the way vLLM's own tests do (see its docstring).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MARK = "H4-ENGINE "


# ---------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelSpec:
    """Shape and seed of a generated Llama model (head size = hidden / heads)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    dtype: str
    weight_std: float
    max_positions: int
    seed: int = 1

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the model dtype (what Maru stores per token)."""
        elem = 4 if self.dtype == "float32" else 2
        return self.layers * 2 * self.kv_heads * self.head_size * elem


GPU_MODEL = ModelSpec(32, 4096, 4096, 32, 8, 4096, "bfloat16", 0.02, 40960)
TINY_MODEL = ModelSpec(2, 128, 256, 4, 2, 1024, "float32", 0.2, 8192)
SPEC_FILE = "h4-model-spec.json"
FIRST_ID = 4  # ids 0..3 are <s>, </s>, <pad>, <unk>; prompts use FIRST_ID..vocab-1


def _write_tokenizer(vocab: int, out: Path) -> None:
    """A word-level tokenizer over ``vocab`` ids: token i is the word ``t<i>``. Nothing to train."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3}
    words.update({f"t{i}": i for i in range(FIRST_ID, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out))


def _llama_tensors(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a Llama checkpoint's tensors (Hugging Face naming)."""
    h, i, kv = spec.hidden, spec.intermediate, spec.kv_heads * spec.head_size
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab, h))]
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (spec.vocab, h))]


def make_model(out_dir: str | os.PathLike[str], spec: ModelSpec) -> Path:
    """Write (or reuse) the model for ``spec`` in ``out_dir``: config, tokenizer, one safetensors file.

    Weights are N(0, weight_std) from a seeded generator (on the GPU when there is one: 3B
    parameters take seconds there), norms are 1. The same spec on the same device kind gives the
    same weights. A directory whose spec file matches is reused as it is.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    out = Path(out_dir)
    marker = out / SPEC_FILE
    if marker.is_file() and json.loads(marker.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(spec.vocab, out)
    LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype=spec.dtype,
    ).save_pretrained(str(out))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    tensors: dict[str, Any] = {}
    for name, shape in _llama_tensors(spec):
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen, device=dev) * spec.weight_std).to(dtype).cpu()
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    if dev == "cuda":
        torch.cuda.empty_cache()  # the engines started next need the memory
    marker.write_text(json.dumps(asdict(spec), sort_keys=True))
    return out


def random_prompt(n: int, seed: int, vocab: int) -> list[int]:
    """``n`` token ids drawn from a seeded generator (prompts of different seeds share no prefix)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def maru_kv_config(extra: dict[str, Any], module: str = "maru.vllm", name: str = "MaruKVConnector") -> dict:
    """vLLM's kv-transfer config for the Maru connector (the only way these files use Maru)."""
    return {
        "kv_connector": name,
        "kv_connector_module_path": module,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


# ----------------------------------------------------------------------------- engine (child side)
def _child_env() -> None:
    for k, v in (
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("VLLM_USE_FLASHINFER_SAMPLER", "0"),
        ("VLLM_HOST_IP", "127.0.0.1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        os.environ.setdefault(k, v)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {
        "model": spec["model"],
        "dtype": spec.get("dtype", "auto"),
        "max_model_len": int(spec["max_model_len"]),
        "block_size": int(spec["block_size"]),
        "enforce_eager": True,
        "seed": 0,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": int(spec["kv_cache_memory_bytes"]),
        "max_num_batched_tokens": int(spec["max_num_batched_tokens"]),
        "enable_chunked_prefill": True,
    }
    for k in ("gpu_memory_utilization", "max_num_seqs", "async_scheduling"):
        if spec.get(k) is not None:
            kw[k] = spec[k]
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    return LLM(**kw)


def _connector_stats(llm: Any) -> dict[str, Any]:
    """Both connector instances' ``maru_stats()`` (both live in this process in in-process mode)."""
    out: dict[str, Any] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group() and hasattr(get_kv_transfer_group(), "maru_stats"):
            out["worker"] = get_kv_transfer_group().maru_stats()
    except Exception as e:  # diagnostics only: a missing counter must not fail the run
        out["worker_error"] = repr(e)
    try:
        core = llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)
        conn = core.scheduler.connector
        if conn is not None and hasattr(conn, "maru_stats"):
            out["scheduler"] = conn.maru_stats()
    except Exception as e:
        out["scheduler_error"] = repr(e)
    return out


def _settle(llm: Any, timeout_s: float) -> dict[str, Any]:
    """Reset vLLM's prefix cache, stepping the engine until it succeeds.

    The reset fails while a finished request's blocks are still held for a write-behind store
    (they are freed a step after the store drained); so a successful reset also means every
    store of the finished requests was published. Afterwards nothing is cached locally: the next
    prompt can only hit Maru.
    """
    t = time.perf_counter()
    steps = 0
    while True:
        if llm.reset_prefix_cache():
            return {"ok": True, "steps": steps, "seconds": time.perf_counter() - t}
        if time.perf_counter() - t > timeout_s:
            return {"ok": False, "steps": steps, "seconds": time.perf_counter() - t}
        llm.llm_engine.step()
        steps += 1
        time.sleep(0.002)  # let the drain thread run


def _outputs(outs: list[Any]) -> dict[str, Any]:
    toks, lps, cached = [], [], []
    for o in outs:
        c = o.outputs[0]
        toks.append([int(t) for t in c.token_ids])
        per_pos = []
        for pos in c.logprobs or []:
            items = [(int(t), float(getattr(lp, "logprob", lp))) for t, lp in pos.items()]
            per_pos.append(sorted(items, key=lambda x: -x[1]))
        lps.append(per_pos)
        cached.append(int(o.num_cached_tokens or 0))
    return {"tokens": toks, "logprobs": lps, "cached": cached}


def child_main(spec_json: str) -> None:
    """The child process: build the engine, answer one JSON command per stdin line."""
    _child_env()
    spec = json.loads(spec_json)
    t0 = time.perf_counter()
    llm = _build_llm(spec)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _reply({"ready": True, "startup_s": time.perf_counter() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=int(cmd.get("max_tokens", 1)),
                    ignore_eos=True,
                    logprobs=cmd.get("logprobs"),
                )
                prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in cmd["prompts"]]
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                dt = time.perf_counter() - t
                _reply({"seconds": dt, **_outputs(outs)})
            elif op == "settle":
                _reply(_settle(llm, float(cmd.get("timeout_s", 60))))
            elif op == "stats":
                _reply(_connector_stats(llm))
            elif op == "quit":
                _reply({"bye": True})
                break
            else:
                _reply({"error": f"unknown op {op!r}"})
        except Exception as e:
            _reply({"error": f"{type(e).__name__}: {e}"})
    os._exit(0)  # vLLM's interpreter-exit cleanup is slow and has nothing left to flush


# ---------------------------------------------------------------------------- engine (parent side)
class Engine:
    """A handle on one child engine: ``start()`` (returns at once), ``wait_ready()``, ``call()``, ``close()``.

    The child's own output (vLLM's logging) goes to ``log_path``; replies come on stdout lines
    marked ``H4-ENGINE``. The child runs in its own process group, killed whole by ``close()``.
    """

    def __init__(self, name: str, spec: dict[str, Any], log_path: Path, env: dict[str, str] | None = None):
        self.name, self.spec, self.log_path, self.env = name, spec, Path(log_path), env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._log: Any = None

    def start(self) -> Engine:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=str(REPO),
            text=True,
            bufsize=1,
            start_new_session=True,
        )

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith(MARK):
                    self._q.put(json.loads(line[len(MARK) :]))
                else:
                    self._log.write(line)
                    self._log.flush()
            self._q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        return self

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            msg = self._q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"engine {self.name}: no answer in {timeout:.0f} s (log {self.log_path})"
            ) from None
        if msg is None:
            raise RuntimeError(f"engine {self.name} exited (log {self.log_path}):\n{tail(self.log_path)}")
        return msg

    def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        if not self.ready:
            self.ready = self._next(timeout)
        return self.ready

    def call(self, cmd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.wait_ready()
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        r = self._next(timeout)
        if "error" in r:
            raise RuntimeError(f"engine {self.name}: {cmd.get('op')} failed: {r['error']}")
        return r

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, logprobs: int | None = None) -> dict:
        return self.call(
            {"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs}
        )

    def settle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.call({"op": "settle", "timeout_s": timeout_s}, timeout=timeout_s + 30)

    def stats(self) -> dict[str, Any]:
        return self.call({"op": "stats"})

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None and self.ready and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()


def tail(path: str | os.PathLike[str], lines: int = 30) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def worker_counters(stats: dict[str, Any]) -> dict[str, float]:
    """The numeric worker-side counters of a ``stats`` reply (empty when the connector is absent)."""
    w = stats.get("worker") or {}
    return {k: v for k, v in w.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    a, b = worker_counters(after), worker_counters(before)
    return {k: a[k] - b.get(k, 0) for k in a}


# --------------------------------------------------------------------------------- API server
class ApiServer:
    """vLLM's OpenAI-compatible server in its own process group (``start()`` returns at once)."""

    def __init__(self, name: str, spec: dict[str, Any], port: int, log_path: Path):
        self.name, self.spec, self.port, self.log_path = name, spec, port, Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        s = self.spec
        a = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", s["model"], "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", s.get("dtype", "auto"), "--block-size", str(s["block_size"]),
            "--max-model-len", str(s["max_model_len"]), "--enforce-eager", "--seed", "0",
            "--enable-prefix-caching", "--kv-cache-memory-bytes", str(s["kv_cache_memory_bytes"]),
            "--max-num-batched-tokens", str(s["max_num_batched_tokens"]),
        ]  # fmt: skip
        if s.get("gpu_memory_utilization") is not None:
            a += ["--gpu-memory-utilization", str(s["gpu_memory_utilization"])]
        if s.get("kv_transfer_config"):
            a += ["--kv-transfer-config", json.dumps(s["kv_transfer_config"])]
        return a

    def start(self) -> ApiServer:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=str(REPO), start_new_session=True,
            )  # fmt: skip
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"API server {self.name} exited:\n{tail(self.log_path)}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"API server {self.name} not ready in {timeout:.0f} s:\n{tail(self.log_path)}")

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=20)
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.proc = None


def stream_ttft(port: int, prompt: list[int], max_tokens: int, timeout: float = 300.0) -> dict[str, Any]:
    """One streaming ``/v1/completions`` request: seconds to the first token, to the end, and the text."""
    body = json.dumps(
        {
            "model": "m",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:500]!r}")
    first = None
    text = []
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        ch = ev.get("choices") or []
        if ch and ch[0].get("text"):
            if first is None:
                first = time.perf_counter() - t0
            text.append(ch[0]["text"])
    total = time.perf_counter() - t0
    c.close()
    return {"ttft": first if first is not None else total, "total": total, "text": "".join(text)}


# ------------------------------------------------------------------------------- output checks
def same_greedy(out: list[int], lps: list[list[Any]], ref: list[int], ref_lps: list[list[Any]]) -> str:
    """Compare two greedy outputs of one prompt: ``"identical"``, ``"close"`` or ``"different"``.

    On a GPU in bf16 two correct runs can differ in the last bits (other batch shapes pick other
    kernels), and a near-tie can then flip a greedy token; everything after it diverges. As
    vLLM's own tests do, a divergence counts as ``"close"`` when at the first differing position
    each side's token is among the other side's top log-probabilities (and the outputs are
    identical up to there). Anything else (wrong KV) is ``"different"``. Needs ``logprobs`` >= 2.
    """
    if out == ref:
        return "identical"
    for i, (a, b) in enumerate(zip(out, ref, strict=False)):
        if a != b:
            if i >= len(lps) or i >= len(ref_lps):
                return "different"
            mine = {int(t) for t, _ in lps[i]}
            theirs = {int(t) for t, _ in ref_lps[i]}
            return "close" if (b in mine and a in theirs) else "different"
    return "different"  # one is a strict prefix of the other (lengths differ)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(sys.argv[2])
    else:
        print(
            "usage: python bench/vllm_harness.py --child '<engine json>' (started by Engine)", file=sys.stderr
        )
        raise SystemExit(2)
