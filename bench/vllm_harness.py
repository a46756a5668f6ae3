"""Pieces of the real-vLLM benchmark and GPU end-to-end tests: a generated model, engines in child processes.

Maru is used through vLLM's kv-transfer config and the connector's ``maru_stats()``; the engine
process is ``maru.demo.runner`` (the one the demo and the CPU tests drive):

- ``ModelSpec`` / ``make_model``: a Llama model with random weights and a word-level tokenizer
  built locally (no downloads). Not ``maru.demo.tiny_model``: this one draws the weights on the
  GPU straight into a safetensors file (``GPU_MODEL`` has 3B parameters; the demo's builds the
  model in CPU memory) and its word-level tokenizer makes every id a word. ``GPU_MODEL`` has Llama-3-8B's KV geometry (32 layers, 8 KV
  heads of 128, bf16; hidden 4096, intermediate 4096: about 3B parameters); ``TINY_MODEL`` is
  small enough for vLLM's CPU build on two cores.
- ``Engine``: one ``vllm.LLM`` in its own process, driven by JSON lines: the demo's runner
  (``maru.demo.runner.EngineProcess``, in-process engine mode inside) with a name and the GPU
  engines' settings. Several can be started at once (their start-ups overlap) and driven one
  after the other.
- ``ApiServer``: ``python -m vllm.entrypoints.openai.api_server`` in its own process group, and
  ``stream_ttft``, one streaming completion timed to its first token.
- ``same_greedy``: greedy outputs compared the way vLLM's own tests do (see its docstring).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from maru.demo.runner import EngineProcess

REPO = Path(__file__).resolve().parent.parent


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


def log(msg: str) -> None:
    """A progress line with the wall-clock time, flushed (the device pass streams it)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def host_facts(loop_n: int = 2_000_000) -> str:
    """The host's CPU model, its CPU count, and the best of three runs of a fixed pure-Python loop:
    two starts of one machine kind ran the same API workload 1.6x apart (bench/RESULTS.md, fortieth
    pass), and the storing cost with them; a pass says which host it had."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    best = float("inf")
    for _ in range(3):
        t, x = time.perf_counter(), 0
        for i in range(loop_n):
            x += i
        best = min(best, time.perf_counter() - t)
    return f"{model}, {os.cpu_count()} CPUs, Python loop of {loop_n:,} adds {best * 1e3:.0f} ms"


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


# ------------------------------------------------------------------------------------- engine
# Settings of the GPU engines that the demo's runner does not set itself.
ENGINE_ENV = {"VLLM_NO_USAGE_STATS": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


class Engine(EngineProcess):
    """One ``vllm.LLM`` in its own process: ``maru.demo.runner``, named, logging to ``log_path``.

    ``start()`` returns at once (start several, their start-ups overlap), ``wait_ready()`` waits;
    ``call()`` raises on an error reply. The runner runs in its own process group, killed whole by
    ``close()``.
    """

    def __init__(self, name: str, spec: dict[str, Any], log_path: Path, env: dict[str, str] | None = None):
        child_env = dict(ENGINE_ENV)
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
        )
        child_env["PYTHONUNBUFFERED"] = "1"
        child_env.update(env or {})
        alt = child_env.get("MARU_BENCH_ALT_TREE_USED")
        if alt:  # another checkout's maru first (an A/B); run there: ``-m`` puts the cwd first
            child_env["PYTHONPATH"] = os.pathsep.join((alt, child_env["PYTHONPATH"]))
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        super().__init__(spec, env=child_env, log_path=log_path, cwd=alt or str(REPO))
        self.name = name

    def start(self, timeout: float = 600.0, wait: bool = False) -> Engine:
        super().start(timeout, wait=wait)
        return self

    def wait_ready(self, timeout: float = 600.0) -> dict[str, Any]:
        try:
            return super().wait_ready(timeout)
        except (TimeoutError, RuntimeError) as e:
            raise type(e)(f"engine {self.name}: {e}") from None

    def call(self, cmd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        self.wait_ready()
        r = super().call(cmd, timeout)
        if "error" in r:
            raise RuntimeError(f"engine {self.name}: {cmd.get('op')} failed: {r['error']}")
        return r

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, logprobs: int | None = None) -> dict:
        """``{"tokens", "logprobs", "cached", "seconds"}`` of one greedy batch."""
        r = self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs})
        r["tokens"] = r.pop("outputs")
        r.setdefault("logprobs", [[] for _ in prompts])
        return r

    def settle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.call({"op": "settle", "timeout_s": timeout_s}, timeout=timeout_s + 30)

    def stats(self) -> dict[str, Any]:
        return self.call({"op": "stats"})


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

    def __init__(
        self, name: str, spec: dict[str, Any], port: int, log_path: Path, env: dict[str, str] | None = None
    ):
        self.name, self.spec, self.port, self.log_path = name, spec, port, Path(log_path)
        self.env = dict(env or {})  # on top of this process's environment (e.g. the model runner)
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        s = self.spec
        a = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", s["model"], "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", s.get("dtype", "auto"), "--block-size", str(s["block_size"]),
            "--max-model-len", str(s["max_model_len"]), "--seed", "0",
            "--enable-prefix-caching", "--kv-cache-memory-bytes", str(s["kv_cache_memory_bytes"]),
            "--max-num-batched-tokens", str(s["max_num_batched_tokens"]),
        ]  # fmt: skip
        if s.get("gpu_memory_utilization") is not None:
            a += ["--gpu-memory-utilization", str(s["gpu_memory_utilization"])]
        if s.get("enforce_eager", True):  # CUDA graphs (and torch.compile) only when asked: --api-graphs
            a += ["--enforce-eager"]
        if s.get("kv_transfer_config"):
            a += ["--kv-transfer-config", json.dumps(s["kv_transfer_config"])]
        return a

    def start(self) -> ApiServer:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        env.update({"PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"})
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # Each server's /metrics its own: vLLM keeps Prometheus counters in files under this folder
        # where it is set, so servers that inherit one (a parent that ran vLLM in process sets it
        # for itself, pytest in CI) report each other's counts (2026-12-06: a plain instance showed
        # a warm one's external hits). Unset, each server makes its own where it needs one.
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        alt = self.env.get("MARU_BENCH_ALT_TREE_USED")
        if alt:  # another checkout's maru first (an A/B); run there: ``-m`` puts the cwd first
            env["PYTHONPATH"] = os.pathsep.join((alt, env["PYTHONPATH"]))
        env.update({k: v for k, v in self.env.items() if k != "PYTHONPATH"})
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_from = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=alt or str(REPO), start_new_session=True,
            )  # fmt: skip
        return self

    def lost_a_port_race(self) -> bool:
        """Whether this start failed because a port vLLM picked was taken before it bound it
        (EADDRINUSE: vLLM picks its torch.distributed rendezvous port free, then binds it later, and
        instances started together can pick the same one). Such a start is worth one more try."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(getattr(self, "_log_from", 0))
                text = f.read().decode(errors="replace")
        except OSError:
            return False
        return "EADDRINUSE" in text or "Address already in use" in text

    def wait_ready(self, timeout: float = 600.0, port_retries: int = 2) -> None:
        """Wait until the server answers /health; a start that lost a port race (``lost_a_port_race``)
        is started again, up to ``port_retries`` times, said in the log."""
        for attempt in range(port_retries + 1):
            try:
                return self._wait_ready(timeout)
            except RuntimeError:
                if attempt == port_retries or not self.lost_a_port_race():
                    raise
                log(f"api {self.name}: a port was taken while it started (EADDRINUSE); starting it again")
                self.close()
                self.start()

    def _wait_ready(self, timeout: float) -> None:
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
# vLLM's own per-request timings (Prometheus histograms of its OpenAI server): measured inside the
# server, so neither the HTTP client nor the streaming of other requests is in them.
SERVER_TIMINGS = {
    "ttft": "vllm:time_to_first_token_seconds",  # arrival in the server to the first token
    "queue": "vllm:request_queue_time_seconds",  # waiting to be scheduled (a parked async load too)
    "prefill": "vllm:request_prefill_time_seconds",  # first scheduled to the first token
}


# vLLM's token counters (same ``/metrics``): where each prompt token came from, and preemptions.
# A counter this vLLM does not export reads 0.
SERVER_COUNTERS = {
    "prompt": "vllm:prompt_tokens",  # prompt tokens of the requests that started
    "local_hit": "vllm:prefix_cache_hits",  # of those, found in vLLM's own prefix cache
    "external_hit": "vllm:external_prefix_cache_hits",  # found through the connector (Maru)
    "preempted": "vllm:num_preemptions",
}


def _metric_sums(text: str, names: dict[str, str], suffixes: tuple[str, ...]) -> dict[str, list[float]]:
    """Per key of ``names``: each suffix's value summed over the metric's label sets."""
    out: dict[str, list[float]] = {k: [0.0] * len(suffixes) for k in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, metric in names.items():
            for i, suffix in enumerate(suffixes):
                head = metric + suffix
                if line.startswith(head) and line[len(head) : len(head) + 1] in ("{", " "):
                    out[key][i] += float(line.rsplit(" ", 1)[1])
    return out


def server_metrics(
    port: int, timeout: float = 10.0
) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """One read of the server's ``/metrics``: ``({timing: (sum of seconds, count)}`` of
    ``SERVER_TIMINGS``, ``{counter: value}`` of ``SERVER_COUNTERS})``, each summed over label sets;
    subtract two reads for the requests in between."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode(errors="replace")
    timings = _metric_sums(text, SERVER_TIMINGS, ("_sum", "_count"))
    counters = _metric_sums(text, SERVER_COUNTERS, ("_total",))
    return {k: (v[0], v[1]) for k, v in timings.items()}, {k: v[0] for k, v in counters.items()}


def timing_means(
    after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean seconds per request of each server timing between two scrapes (absent when none)."""
    out = {}
    for k, (s1, n1) in after.items():
        s0, n0 = before.get(k, (0.0, 0.0))
        if n1 > n0:
            out[k] = (s1 - s0) / (n1 - n0)
    return out


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
