#!/usr/bin/env bash
# One device call for the GPU side of issue 10's async-load work, after the vLLM bundle is installed
# (the third bundle call; see docs/gpu.md): the gpu-marked tests other than the real-vLLM end to
# end (vLLM present, so the write-behind worker tests run too), the kernels' quick self-check, then
# the figures: a load issued beside a spinning thread (bench/gil_contention.py), the connector
# level with its time breakdown (bench/gpu_connector.py), host time per public kv_ops call
# (bench/kv_ops_host.py --cuda). Results to $OUT. Run from the repo root.
set -o pipefail
OUT=${OUT:-/tmp/out}
source "$(dirname "$0")/device_env.sh" || exit 1
if [ ! -d /tmp/site/vllm ] && [ -f .vllmx/install.sh ]; then
  mkdir -p /tmp/vp && mv .vllmx/p2 .vllmx/bundle.sha256 /tmp/vp/ 2>/dev/null
  bash .vllmx/install.sh >/dev/null || echo "vLLM bundle install failed: $(ls /tmp/vp)"
fi
export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
T0=$(date +%s)
timeout 120 python3 -m maru.kv_ops.selfcheck --device cuda --quick 2>&1 | tail -2
timeout "${TESTS_S:-240}" python3 -m pytest -q -p no:cacheprovider -m gpu -W ignore::DeprecationWarning \
  --ignore=tests/e2e ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
echo "tests took $(( $(date +%s) - T0 )) s"
timeout 90 python3 bench/gil_contention.py --json "$OUT/gil_contention.json" 2>&1 | tee "$OUT/gil.log" | tail -10
timeout 60 python3 bench/kv_ops_host.py --cuda 2>&1 | tail -4 | tee "$OUT/kv_ops_host.log"
timeout 200 python3 bench/gpu_connector.py --json "$OUT/gpu_connector.json" 2>&1 | tee "$OUT/connector.log" | tail -10
echo "pass took $(( $(date +%s) - T0 )) s"
