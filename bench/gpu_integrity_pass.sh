#!/usr/bin/env bash
# One device call for integrity on the GPU (issue 11): the gpu-marked tests of the checksum work,
# the kernels' self-check (includes the checksum fused into the direct layer kernel), then the data
# path benchmark; its "integrity" table (load GB/s with vs without checksum, % of pinned) is last.
# Run on the device machine from the repo root: bash bench/gpu_integrity_pass.sh
set -o pipefail
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
timeout 200 python3 -m maru.kv_ops.selfcheck --device cuda --quick 2>&1 | tail -4
# These tests start a real maru server (the suite's conftest): no --noconftest here.
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore::DeprecationWarning \
  tests/transfer/test_transfer_integrity_gpu.py 2>&1 | tee "$OUT/integrity_tests.log" | tail -25
echo "tests took $(( $(date +%s) - T0 )) s"
timeout 200 python3 bench/gpu_connector.py --json "$OUT/gpu_connector.json" 2>&1 | tee "$OUT/connector.log" | tail -8
timeout 330 python3 bench/gpu_datapath.py --quick --json "$OUT/gpu_datapath.json" 2>&1 | tee "$OUT/bench.log" \
  | sed -n '/^integrity:/,$p'
