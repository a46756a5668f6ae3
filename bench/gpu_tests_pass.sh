#!/usr/bin/env bash
# One device-machine pass over every GPU test (no benchmarks): the check to run before calling
# GPU work done. Carry `.whl` (pyzmq) through the device tool; see bench/gpu_pass_kv_ops.sh.
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
rc=0
# --noconftest: the CPU suite's conftest fixtures are not needed by the GPU tests. Only the files
# that hold GPU tests are collected: the others import packages the device lacks (hypothesis).
# 420 s: the ~195 tests with a fresh host's Triton compiles ran past 300 s on 2026-12-05.
timeout 420 python3 -m pytest --noconftest -q -p no:cacheprovider -W ignore::DeprecationWarning -rf \
  -m gpu $(grep -rl "pytest.mark.gpu" tests --include="test_*.py") 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 || rc=1
# The transfer engine's layout round trips on CUDA caches (a real maru server process).
MARU_TEST_DEVICE=cuda timeout 140 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/transfer/test_transfer.py 2>&1 | tee "$OUT/transfer_cuda.log" | tail -8 || rc=1
exit $rc
