#!/usr/bin/env bash
# One device call: LMCache beside vLLM 0.26, the GPU tests of Maru's LMCache backend
# (tests/lmcache -m gpu, tests/e2e/test_gpu_lmcache_e2e.py), then the side-by-side benchmark
# (bench/gpu_lmcache_e2e.py: cold; warm LMCache + Maru; warm Maru's own connector; warm LMCache's
# local CPU backend), its table last. Results to $OUT: tests.log, bench.log,
# gpu_lmcache_e2e.{json,md,png}, logs.tgz (every engine's log), lmcache_import.log.
# Before: vLLM installed at /tmp/site (the gpu-vllm bundle, see bench/gpu_vllm_pass.sh; if it is
# not there and .vllmx/ was carried, it is installed here); the LMCache wheels from
# bench/lmcache_wheels.sh carried as .whl/lmcache/ now, or copied to /tmp/lw by an earlier call.
# LMCache versions are tried newest first; if none imports, the full errors are printed and the
# last line says "blocked: ...". Budgets (seconds): TESTS_S (default 170), BENCH_S (310).
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
SITE=${VLLM_SITE:-/tmp/site}  # where the vLLM bundle is unpacked
if [ ! -d "$SITE/vllm" ]; then
  mkdir -p /tmp/vp && mv .vllmx/p2 .vllmx/bundle.sha256 /tmp/vp/ 2>/dev/null
  bash .vllmx/install.sh || { echo "blocked: vLLM bundle not installed ($(ls /tmp/vp 2>&1))"; exit 1; }
fi
WH=${LMCACHE_WHEELS:-.whl/lmcache}; [ -d "$WH" ] || WH=/tmp/lw
[ -d "$WH" ] || { echo "blocked: no LMCache wheels (carry .whl/lmcache from bench/lmcache_wheels.sh)"; exit 1; }
BASE="$SITE:$PWD"
# LMCACHE_TRACK_USAGE=false: no usage telemetry (the machine has no network; nothing waits on it).
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
df -h /dev/shm /tmp | tail -2
PYTHONPATH=$BASE python3 -c "import torch, vllm, numpy; print('torch', torch.__version__, 'vllm', vllm.__version__, 'numpy', numpy.__version__)"
# The small dependencies, each only if this machine lacks it (never shadow what vLLM runs with).
mkdir -p /tmp/lsite/deps
for pair in aiofile:aiofile caio:caio sortedcontainers:sortedcontainers; do
  mod=${pair%%:*}; dist=${pair##*:}
  if ! PYTHONPATH=$BASE python3 -c "import $mod" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lsite/deps "$WH"/$dist-*.whl \
      && echo "installed $dist from $WH"
  fi
done
SHIM=""
if ! PYTHONPATH=$BASE python3 -c "import numba" 2>/dev/null; then
  SHIM="$PWD/bench/lmcache_shim"
  echo "numba is not installed here: bench/lmcache_shim stands in for it (LMCache imports numba.njit" \
       "for CPU codec kernels this path never calls; see bench/lmcache_wheels.sh)"
fi
# LMCache's own vLLM adapter first; if it does not import beside this vLLM, vLLM's copy of it
# (kv_connector_extra_config use_native, MARU_LMCACHE_NATIVE=1 below).
CHECK='import lmcache, torch, traceback
from maru.lmcache.backend import MaruStorageBackend
print("lmcache", lmcache.__version__, "and maru.lmcache import; torch", torch.__version__)
try:
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl
    print("ADAPTER lmcache")
except Exception:
    traceback.print_exc()
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration.vllm_v1_adapter import LMCacheConnectorV1Impl
    print("ADAPTER native (LMCache adapter failed above; vLLM use_native copy imports)")
for ops in ("lmcache.cuda_ops", "lmcache.c_ops"):  # 0.5.4 and later / 0.5.3 and earlier
    try:
        __import__(ops)
        print(ops, "loads")
        break
    except ModuleNotFoundError:
        continue
    except Exception as e:
        print(ops, "does NOT load (LMCache falls back to torch ops):", type(e).__name__, e)
        break
else:
    print("no compiled LMCache ops in this release")'
CHOSEN=""; TRIED=""
for v in $(ls -1 "$WH" | grep -E '^[0-9]+\.[0-9]+\.[0-9]+$' | sort -rV); do
  rm -rf "/tmp/lsite/$v"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "/tmp/lsite/$v" "$WH/$v"/lmcache-*.whl || continue
  TRY="/tmp/lsite/$v:/tmp/lsite/deps${SHIM:+:$SHIM}:$BASE"
  echo "== trying lmcache $v" | tee -a "$OUT/lmcache_import.log"
  if PYTHONPATH=$TRY timeout 300 python3 -c "$CHECK" >>"$OUT/lmcache_import.log" 2>&1; then
    CHOSEN=$v; export PYTHONPATH=$TRY; tail -3 "$OUT/lmcache_import.log"
    if tail -3 "$OUT/lmcache_import.log" | grep -q "ADAPTER native"; then export MARU_LMCACHE_NATIVE=1; fi
    break
  fi
  tail -25 "$OUT/lmcache_import.log"; TRIED="$TRIED $v"
done
BLOCKED=""
if [ -z "$CHOSEN" ]; then
  echo "full import errors: $OUT/lmcache_import.log"
  BLOCKED="blocked: LMCache does not import beside torch $(PYTHONPATH=$BASE python3 -c 'import torch; print(torch.__version__)') (tried:$TRIED); the benchmark runs its other rows"
  echo "$BLOCKED"
  export PYTHONPATH="/tmp/lsite/deps:$BASE"
fi
LOGS=/tmp/lmclogs && mkdir -p "$LOGS"
export MARU_GPU_E2E_LOG_DIR="$LOGS"
rc=0
[ -n "$BLOCKED" ] || timeout -s INT -k 30 "${TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider \
  -W ignore::DeprecationWarning -m gpu tests/lmcache tests/e2e/test_gpu_lmcache_e2e.py 2>&1 | tee "$OUT/tests.log" | tail -40 || rc=1
[ "${BENCH_S:-310}" = 0 ] || timeout -s INT -k 30 "${BENCH_S:-310}" python3 bench/gpu_lmcache_e2e.py --out "$OUT" \
  --log-dir "$LOGS" 2>&1 | grep -v "LMCache INFO" | tee "$OUT/bench.log" || rc=1
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
echo "lmcache ${CHOSEN:-none}; rc=$rc"
grep -E '^\|' "$OUT/gpu_lmcache_e2e.md" 2>/dev/null
if [ -n "$BLOCKED" ]; then echo "$BLOCKED"; exit 1; fi
exit $rc
