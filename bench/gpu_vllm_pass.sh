#!/usr/bin/env bash
# One device call: vLLM 0.26 from the gpu-vllm bundle, the GPU end-to-end tests with real vLLM
# (tests/e2e/test_gpu_vllm_e2e.py), then the benchmark (bench/gpu_vllm_e2e.py), its table last.
# Results to $OUT: tests.log, bench.log, gpu_vllm_e2e.{json,md,png}, hook_lines.log (each engine's
# last hook-time lines), logs.tgz (every engine's log).
# Before: the bundle pieces p0, p1 in /tmp/vp (earlier calls, see docs/gpu.md); p2, bundle.sha256
# and install.sh in .vllmx/ (carried). Budgets (seconds): TESTS_S (default 200), BENCH_S (300); 0 skips that part.
# TEST_PATHS: the GPU test files to run (default tests/e2e/test_gpu_vllm_e2e.py and the sleep-mode test).
# Example: API_LOADS="default sync overlap async" BENCH_S=420 bash bench/gpu_vllm_pass.sh
#          API_STORES="sync unpaced probe" API_PAIR=1 bash bench/gpu_vllm_pass.sh
#          API_LOADS="default copied overlap overlap-copied" bash bench/gpu_vllm_pass.sh  (the layer
#          load through the copy engines, maru_layer_path=copied, against the direct way)
#          API_STORES="idle alt-switch-500" bash bench/gpu_vllm_pass.sh  (a storing instance whose
#          engine runs a 0.5 ms GIL switch interval: make it first with `python bench/ab_tree.py
#          switch-500` and carry .ab/switch-500; the attached idle connector as the baseline)
#          TEST_PATHS=tests/kv_ops/test_paced_store_gpu.py TESTS_S=120 DRAIN_CPU=1 BENCH_S=0 UNPACED_S=0
#          bash bench/gpu_vllm_pass.sh  (the paced store's GPU tests and the drain's CPU, GIL and launches)
#          MPS=1 API_STORES="helper alt-helper-nodevice" bash bench/gpu_vllm_pass.sh  (every process a
#          client of an MPS server started here, stopped at the end: kernels of the store helper and of
#          vLLM run side by side instead of taking time slices; docs/gpu.md "The store helper")
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
if [ ! -d /tmp/site/vllm ]; then
  mkdir -p /tmp/vp && mv .vllmx/p2 .vllmx/bundle.sha256 /tmp/vp/ 2>/dev/null
  bash .vllmx/install.sh || { echo "vLLM bundle install failed: $(ls /tmp/vp)"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
LOGS=/tmp/h4logs && mkdir -p "$LOGS"
export MARU_GPU_E2E_LOG_DIR="$LOGS"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
df -h /dev/shm /tmp | tail -2
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
rc=0
if [ "${MPS:-0}" = 1 ]; then
  # MPS: the processes' kernels share the GPU's SMs concurrently (without it, two processes' kernels
  # take turns by time slices). Directories of its own; the daemon is stopped at the end.
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS=1: nvidia-cuda-mps-control -d failed"; exit 1; }
  trap 'echo quit | nvidia-cuda-mps-control; cp -r /tmp/mps/log "$OUT/mps-log" 2>/dev/null' EXIT
  echo "MPS control daemon started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
fi
# SIGINT, not SIGTERM: the engines run in their own sessions; an interrupt lets the harness close them.
[ "${TESTS_S:-200}" = 0 ] || timeout -s INT -k 30 "${TESTS_S:-200}" python3 -m pytest --noconftest -q -p no:cacheprovider \
  -W ignore::DeprecationWarning -m gpu ${TEST_PATHS:-tests/e2e/test_gpu_vllm_e2e.py tests/e2e/test_gpu_vllm_sleep_e2e.py} 2>&1 | tee "$OUT/tests.log" | tail -40 || rc=1
# DRAIN_CPU=1: bench/drain_cpu.py alone, --gil, then --launches (the drain's CPU a store batch, and
#   what a counting thread and a kernel-launching thread lose beside it; DRAIN_S seconds each,
#   default 120), to $OUT/drain_cpu.log, between the tests and the benchmark.
if [ "${DRAIN_CPU:-0}" = 1 ]; then
  for beside in "" --gil --launches; do
    echo "== bench/drain_cpu.py $beside"
    timeout -s INT -k 10 "${DRAIN_S:-120}" python3 bench/drain_cpu.py --reps 8 --profile 0 $beside 2>&1 | tail -8
  done | tee "$OUT/drain_cpu.log" || rc=1
fi
# API_LOADS: load modes of the warm API instances (default: the default configuration only;
#   alt-<name>: the default configuration from the tree .ab/<name>, paired with this tree's warm one);
# API_STORES: store variants of extra cold API instances (e.g. "sync unpaced probe"; default none);
# API_PAIR=1: the two-instance passes (users alternate between two instances every round);
# API_REPS: repetitions of the multi-round passes (default: the setup's, 3 on the GPU);
# API_GIL_PROBE_MS: the API instances with a connector run the GIL probe at this period (ms);
# API_GRAPHS=1: the API servers with vLLM's default CUDA graphs and torch.compile (not eager);
# API_UNTIMED=1: the API instances without maru_log_timing (the default configuration as deployed;
#   no hook lines from them: tokens from Maru read from vLLM's external prefix-cache hits);
# VLLM_USE_V2_MODEL_RUNNER=0 in the environment: every instance on the V1 runner (same-step loads);
# MARU_HOOK_PARTS=0: the engines' hook lines without their parts (keys, probe, pins: ~5 us a timed
#   call), so the TTFTs are the default configuration's (a tree before 64b0c37 times them anyway);
# MARU_PROFILE=N (or N:site,site): the engines profile one call in N of their hooks and drain thread
#   (maru/vllm/sampled_profile.py; each engine's last table per site in $OUT/profiles.log);
# BENCH_ARGS: more arguments, e.g. "--workloads 1x4k --engines none" (a shorter offline part).
[ "${BENCH_S:-300}" = 0 ] || timeout -s INT -k 30 "${BENCH_S:-300}" python3 bench/gpu_vllm_e2e.py --out "$OUT" --log-dir "$LOGS" \
  --api-loads ${API_LOADS:-default} ${API_STORES:+--api-stores $API_STORES} ${API_PAIR:+--api-pair} \
  ${API_REPS:+--api-reps "$API_REPS"} ${API_GRAPHS:+--api-graphs} ${API_UNTIMED:+--api-untimed} ${API_GIL_PROBE_MS:+--api-gil-probe-ms "$API_GIL_PROBE_MS"} ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" || rc=1
# The write-behind store queued all at once (maru_paced_store false), on its own: what pacing is worth.
[ "${UNPACED_S:-100}" = 0 ] || timeout -s INT -k 30 "${UNPACED_S:-100}" python3 bench/gpu_vllm_e2e.py --out "$OUT/unpaced" \
  --log-dir "$LOGS/unpaced" --engines none unpaced --no-api --reps 2 2>&1 | tee "$OUT/bench_unpaced.log" | tail -12 || rc=1
# Each engine's last hook-time lines (scheduler and worker: host time, and the device time of the forwards).
for f in "$LOGS"/*.log; do
  echo "== $(basename "$f")"
  grep "host time in vLLM's hooks (scheduler" "$f" | tail -1
  grep "host time in vLLM's hooks (worker" "$f" | tail -1
done > "$OUT/hook_lines.log" 2>/dev/null
# MARU_PROFILE in the environment: each engine's last profile table of each site.
for f in "$LOGS"/*.log; do
  grep -q "Maru: profile of " "$f" || continue
  echo "== $(basename "$f")"
  awk '/Maru: profile of /{site=$0; sub(/.*Maru: profile of /, "", site); sub(/:.*/, "", site); cur=site; buf[cur]=""; n[cur]=0}
       cur!="" {if (n[cur]++ < 42) buf[cur]=buf[cur] $0 "\n"}
       END{for (k in buf) printf "%s\n", buf[k]}' "$f"
done > "$OUT/profiles.log" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
exit $rc
