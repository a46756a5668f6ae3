#!/usr/bin/env bash
# One device call: GPU tests of the data path, then the benchmark (short table printed last).
# Run on the device machine from the repo root: bash bench/gpu_datapath_pass.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
df -h /dev/shm | tail -1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
# The kernels against the reference on CUDA tensors (includes the direct zero-copy layer kernel).
timeout 200 python3 -m maru.kv_ops.selfcheck --device cuda --quick 2>&1 | tail -4
# --noconftest: the suite's conftest starts ZeroMQ servers; these tests need none.
PYTEST="python3 -m pytest --noconftest -q -p no:cacheprovider -x -W ignore::DeprecationWarning"
if [ -n "${SKIP_TESTS:-}" ]; then
  echo "tests skipped (SKIP_TESTS)"
elif ! timeout 200 $PYTEST ${TESTS:-tests/kv_ops/test_device_pipeline_gpu.py} 2>&1 | tee "$OUT/tests.log" | tail -30; then
  echo "=== tests failed with the default backend; again with the reference backend (engine vs kernel) ==="
  MARU_TEST_BACKEND=reference timeout 120 $PYTEST ${TESTS:-tests/kv_ops/test_device_pipeline_gpu.py} 2>&1 | tee "$OUT/tests_ref.log" | tail -15
fi
echo "tests took $(( $(date +%s) - T0 )) s"
if ! timeout 300 python3 bench/gpu_datapath.py --json "$OUT/gpu_datapath.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40; then
  echo "=== bench failed with the default backend; again with the reference backend ==="
  timeout 150 python3 bench/gpu_datapath.py --quick --backend reference --json "$OUT/gpu_datapath_ref.json" 2>&1 | tee "$OUT/bench_ref.log" | tail -30
fi
# Connector level: KVTransferEngine against a real maru server (RPCs included).
timeout 240 python3 bench/gpu_connector.py --json "$OUT/gpu_connector.json" 2>&1 | tee "$OUT/connector.log" | tail -12
