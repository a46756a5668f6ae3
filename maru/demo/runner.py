"""One vLLM engine in its own process, driven by JSON lines: used by the demo, the tests and the bench.

    python -m maru.demo.runner '<engine json>'

starts ``vllm.LLM`` with the engine settings (model, block size, the Maru connector's extra
config or none, ...), prints ``MARU-RUNNER {"ready": ...}`` and then answers one command per
stdin line with one ``MARU-RUNNER <json>`` line on stdout (vLLM's own logging goes around it):

- ``{"op": "generate", "prompts": [[token ids], ...], "max_tokens": 8}`` ->
  ``{"outputs": [[ids], ...], "cached": [num_cached_tokens, ...], "seconds": wall}``; with
  ``"logprobs": k`` also ``"logprobs"``: per output, per position, ``[[id, logprob], ...]``
  best first; ``"cache_salt": "..."`` gives every prompt vLLM's per-request cache salt, and
  ``"lora": [name, int id, path]`` a LoRA adapter (engine setting ``enable_lora``), and
  ``"image_seeds": [[seed, ...], ...]`` per prompt that many random 56x56 images, made from the
  seeds (a multimodal model: each prompt has its image placeholder token once per image)
- ``{"op": "ttft", "prompt": [ids]}``: one prompt, one output token, timed ->
  ``{"seconds": ..., "cached": n, "token": id}``
- ``{"op": "reset_prefix_cache"}`` (publishes the write-behind stores first and lets vLLM free
  their blocks: ``maru.vllm.settle_stores``, skipped with ``"settle": false``; with
  ``"reset_connector": true`` vLLM also resets the connector's cache, as a weight update does;
  ``"reset_running_requests": true`` as a pause does),
- ``{"op": "sleep", "level": 1}``, ``{"op": "wake_up"}``: vLLM's sleep mode (engine setting
  ``enable_sleep_mode``; CUDA only), the write-behind stores published first,
- ``{"op": "scale_weights", "scale": 1.5}``: a stand-in for a weight update (an RL trainer's):
  the weights of the norms in front of every attention layer scaled in place (each layer's K and
  V change) -> ``{"scaled": n}`` (parameters changed),
  ``{"op": "stats"}`` (the connector's counters, both sides; a store counts once published),
  ``{"op": "flush_stores"}`` (wait until every write-behind store is published), ``{"op": "quit"}``.
- ``{"op": "settle", "timeout_s": 60}``: publish every write-behind store, then step until vLLM's
  prefix cache resets (nothing cached locally) ->
  ``{"ok": bool, "steps": n, "seconds": wall, "flushed": bool}``.

Engine settings beyond the demo's: ``kv_transfer_config`` (vLLM's dict, instead of
``connector``), ``gpu_memory_utilization``, ``async_scheduling`` (the GPU benchmark's),
``enforce_eager`` (default true; false runs vLLM's CUDA graphs and torch.compile).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so one engine per
runner process: vLLM's in-process mode changes process-wide state (threads, seeds).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from maru.vllm.offline import flush_write_behind, settle_delayed_frees, settle_stores

MARK = "MARU-RUNNER "


def _env() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def build_llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=int(spec.get("max_model_len", 2048)),
        block_size=int(spec.get("block_size", 32)),
        # Eager unless asked: CUDA graphs and torch.compile cost start-up time (the GPU graph tests).
        enforce_eager=bool(spec.get("enforce_eager", True)),
        seed=0,
        enable_prefix_caching=bool(spec.get("enable_prefix_caching", True)),
        kv_cache_memory_bytes=int(spec.get("kv_cache_memory_bytes", 256 << 20)),
    )
    if spec.get("max_num_batched_tokens"):
        kw["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
        kw["enable_chunked_prefill"] = True
    if spec.get("log_stats"):
        kw["disable_log_stats"] = False
    if spec.get("max_num_seqs"):
        kw["max_num_seqs"] = int(spec["max_num_seqs"])
    for k in (
        "gpu_memory_utilization",
        "async_scheduling",
        "tensor_parallel_size",
        "distributed_executor_backend",
        "enable_sleep_mode",
        "enable_lora",
        "max_lora_rank",
        "max_loras",
        "limit_mm_per_prompt",
    ):
        if spec.get(k) is not None:
            kw[k] = spec[k]
    conn = spec.get("connector")
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    elif conn is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=conn.get("name", "MaruKVConnector"),
            kv_connector_module_path=conn.get("module", "maru.vllm"),
            kv_role="kv_both",
            kv_connector_extra_config=conn.get("extra", {}),
        )
    return LLM(**kw)


def _image(seed: int) -> Any:
    """A random 56x56 RGB image made from ``seed`` (the same everywhere)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 56, 3), dtype=np.uint8))


def connector_stats(llm: Any) -> dict[str, Any]:
    """Counters of both connector instances (both live in this process in in-process mode)."""
    out: dict[str, Any] = {}
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if has_kv_transfer_group():
            w = get_kv_transfer_group()
            if hasattr(w, "maru_stats"):
                out["worker"] = w.maru_stats()
    except Exception as e:  # stats are diagnostics; never fail the run for them
        out["worker_error"] = repr(e)
    try:
        core = llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)
        sched = core.scheduler.connector
        if sched is not None and hasattr(sched, "maru_stats"):
            out["scheduler"] = sched.maru_stats()
    except Exception as e:
        out["scheduler_error"] = repr(e)
    return out


def settle(llm: Any, timeout_s: float) -> dict[str, Any]:
    """Publish every write-behind store, then reset vLLM's prefix cache, stepping until it succeeds.

    The reset fails while a finished request's blocks are still held for a write-behind store
    (they are freed a step after the store read them). Afterwards every store of the finished
    requests is published (in-process mode; ``flushed`` says whether it was) and nothing is
    cached locally: the next prompt can only hit Maru.
    """
    t = time.perf_counter()
    flushed = flush_write_behind(timeout_s)
    steps = 0
    while True:
        if llm.reset_prefix_cache():
            return {"ok": True, "steps": steps, "seconds": time.perf_counter() - t, "flushed": flushed}
        if time.perf_counter() - t > timeout_s:
            return {"ok": False, "steps": steps, "seconds": time.perf_counter() - t, "flushed": flushed}
        llm.llm_engine.step()
        steps += 1
        time.sleep(0.002)  # let the drain thread run


def _scale_kv_weights(model: Any, scale: float) -> int:
    """Scale the weights of the norms in front of every attention layer (``input_layernorm``) in place:
    each layer's K and V change for the same tokens, as after a weight update. Those weights, not
    the projections': vLLM's CPU build computes its linear layers from a packed copy of their
    weights, which an in-place change does not reach. Returns how many parameters changed."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "input_layernorm" in name:
                p.mul_(float(scale))
                n += 1
    return n


def _logprobs(outs: list[Any]) -> list[list[list[tuple[int, float]]]]:
    """Per output, per position: the ``(token id, logprob)`` pairs vLLM returned, best first."""
    out = []
    for o in outs:
        per_pos = []
        for pos in o.outputs[0].logprobs or []:
            items = [(int(t), float(getattr(lp, "logprob", lp))) for t, lp in pos.items()]
            per_pos.append(sorted(items, key=lambda x: -x[1]))
        out.append(per_pos)
    return out


def serve(spec: dict[str, Any]) -> None:
    _env()
    t0 = time.perf_counter()
    llm = build_llm(spec)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    reply({"ready": True, "startup_s": time.perf_counter() - t0, "pid": os.getpid()})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=int(cmd.get("max_tokens", 8)),
                    ignore_eos=True,
                    logprobs=cmd.get("logprobs"),
                )
                salt = {"cache_salt": cmd["cache_salt"]} if cmd.get("cache_salt") else {}
                prompts = [TokensPrompt(prompt_token_ids=list(p), **salt) for p in cmd["prompts"]]
                for prompt, seeds in zip(prompts, cmd.get("image_seeds") or [], strict=False):
                    if seeds:
                        prompt["multi_modal_data"] = {"image": [_image(int(s)) for s in seeds]}
                lora = None
                if cmd.get("lora"):
                    from vllm.lora.request import LoRARequest

                    name, lora_id, path = cmd["lora"]
                    lora = LoRARequest(str(name), int(lora_id), str(path))
                t = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False, lora_request=lora)
                dt = time.perf_counter() - t
                r = {
                    "outputs": [[int(t) for t in o.outputs[0].token_ids] for o in outs],
                    "cached": [int(o.num_cached_tokens or 0) for o in outs],
                    "seconds": dt,
                }
                if cmd.get("logprobs"):
                    r["logprobs"] = _logprobs(outs)
                reply(r)
            elif op == "ttft":
                sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
                t = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=list(cmd["prompt"]))], sp, use_tqdm=False)
                dt = time.perf_counter() - t
                reply(
                    {
                        "seconds": dt,
                        "cached": int(outs[0].num_cached_tokens or 0),
                        "token": outs[0].outputs[0].token_ids[0],
                    }
                )
            elif op == "reset_prefix_cache":
                # The next prompt should find in Maru what this engine stored: publish first, and
                # let vLLM free the blocks write-behind stores held (its reset fails on them;
                # "settle": false shows it).
                if cmd.get("settle", True):
                    settle_stores(llm)
                ok = llm.reset_prefix_cache(
                    reset_running_requests=bool(cmd.get("reset_running_requests", False)),
                    reset_connector=bool(cmd.get("reset_connector", False)),
                )
                reply({"ok": bool(ok)})
            elif op == "sleep":  # vLLM's sleep mode (engine setting enable_sleep_mode, a GPU)
                settle_stores(llm)  # blocks held for write-behind stores would fail the pause
                llm.sleep(level=int(cmd.get("level", 1)))
                reply({"ok": True})
            elif op == "wake_up":
                llm.wake_up()
                reply({"ok": True})
            elif op == "scale_weights":
                reply(
                    {"scaled": sum(llm.apply_model(functools.partial(_scale_kv_weights, scale=cmd["scale"])))}
                )
            elif op == "settle":
                reply(settle(llm, float(cmd.get("timeout_s", 60))))
            elif op == "stats":
                reply(connector_stats(llm))
            elif op == "flush_stores":
                # In-process mode only: wait for write-behind commits, so a test can rely on them.
                ok = flush_write_behind()
                reply({"ok": ok, "delayed_frees_left": settle_delayed_frees(llm)})
            elif op == "quit":
                reply({"bye": True})
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as e:
            reply({"error": f"{type(e).__name__}: {e}"})
    sys.stdout.flush()
    # In vLLM's multi-process mode the engine core and worker are child processes holding
    # shared-memory ring buffers: shut them down so they neither linger nor leak /dev/shm.
    # (EngineProcess.close() kills the whole process group as the backstop.)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    try:
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    except Exception:
        pass
    os._exit(0)  # skip vLLM's slow interpreter-exit cleanup; nothing is left to flush


class EngineProcess:
    """The parent's handle on one runner process: ``start()``, ``call(cmd)``, ``close()``.

    Lines of the child's stdout without the marker (vLLM's logging) and its stderr go to
    ``log_path`` (or are dropped), so a failing test can show them.
    """

    def __init__(
        self,
        spec: dict[str, Any],
        *,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.spec = spec
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.proc: Any = None
        self.ready: dict[str, Any] = {}
        self._lines: Any = None
        self._log: Any = None

    def start(self, timeout: float = 300.0, wait: bool = True) -> EngineProcess:
        """Start the runner; with ``wait`` (the default) return once its engine is ready.

        ``wait=False`` returns at once: start several, then ``wait_ready()`` each (start-ups overlap).
        """
        import queue
        import subprocess
        import threading

        env = dict(os.environ)
        env.update(self.env or {})
        self._log = open(self.log_path, "a") if self.log_path else open(os.devnull, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "maru.demo.runner", json.dumps(self.spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=self.cwd,
            text=True,
            bufsize=1,
            # Its own process group: close() can then reap vLLM's engine-core and worker
            # children too, even when the runner died before shutting them down.
            start_new_session=True,
        )
        self._lines = queue.Queue()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith(MARK):
                    self._lines.put(json.loads(line[len(MARK) :]))
                else:
                    self._log.write(line)
            self._lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 300.0) -> dict[str, Any]:
        """The runner's ready line (``startup_s``, ``pid``), waiting for it the first time."""
        if not self.ready:
            self.ready = self._next(timeout)
        return self.ready

    def _next(self, timeout: float) -> dict[str, Any]:
        import queue

        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(
                f"vLLM runner gave no answer in {timeout:.0f} s (log: {self.log_path})"
            ) from None
        if msg is None:
            code = self.proc.wait(timeout=30)
            raise RuntimeError(
                f"vLLM runner exited with code {code} (log: {self.log_path}){self._log_tail()}"
            )
        return msg

    def _log_tail(self, lines: int = 30) -> str:
        if not self.log_path:
            return ""
        self._log.flush()
        try:
            text = Path(self.log_path).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return ":\n" + "\n".join(text)

    def call(self, cmd: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            # A runner still starting reads no commands: it is killed at once.
            if self.proc.poll() is None and self.ready:
                self.call({"op": "quit"}, timeout=30)
                self.proc.wait(timeout=30)
        except Exception:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:  # whatever the runner left behind in its group (vLLM's multi-process children)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m maru.demo.runner '<engine json>'", file=sys.stderr)
        return 2
    serve(json.loads(argv[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
