#!/usr/bin/env bash
# One device-machine pass for maru.kv_ops: GPU tests, then the benchmark (short table last).
# Run through the device tool:  bash bench/gpu_pass_kv_ops.sh   (logs also under $OUT when set)
# The pipeline tests import maru.client (pyzmq): carry `.whl` (README of the device tool) to run them.
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kv_ops/test_kv_ops_gpu.py tests/kv_ops/test_kv_ops_variants_gpu.py \
  2>&1 | tee "$OUT/kv_ops_gpu_tests.log" | tail -8
# --noconftest: the suite's conftest starts ZeroMQ servers; the pipeline GPU tests need none.
timeout 120 python3 -m pytest --noconftest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/kv_ops/test_device_pipeline_gpu.py 2>&1 | tee "$OUT/pipeline_gpu_tests.log" | tail -8
[ "${KV_OPS_HND:-0}" = 1 ] && timeout 120 python3 bench/kv_ops.py --quick --layout kv_first/HND 2>&1 | tee "$OUT/kv_ops_bench_hnd.log" | tail -12
timeout 240 python3 bench/kv_ops.py --sweep 2>&1 | tee "$OUT/kv_ops_bench.log"
