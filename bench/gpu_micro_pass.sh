#!/usr/bin/env bash
# One device call, no vLLM: the connector-level figures (bench/gpu_connector.py), the public kv_ops
# call's host time (bench/kv_ops_host.py --cuda, step by step: bench/kv_ops_breakdown.py), the
# layer-overlap issue, per-layer replays against one launch (bench/layer_issue.py), and how long
# the engine's small copies wait behind Maru's chunk copies (bench/copy_interference.py).
# Results to $OUT. Carry `.whl` (pyzmq).
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
timeout 150 python3 bench/gpu_connector.py --json "$OUT/connector.json" 2>&1 | tee "$OUT/connector.log" | tail -8 || rc=1
timeout 60 python3 bench/kv_ops_host.py --cuda 2>&1 | tee "$OUT/kv_ops_host.log" | tail -6 || rc=1
timeout 90 python3 bench/layer_issue.py 2>&1 | tee "$OUT/layer_issue.log" | tail -14 || rc=1
timeout 60 python3 bench/kv_ops_breakdown.py 2>&1 | tee "$OUT/kv_ops_breakdown.log" | tail -22 || rc=1
timeout 90 python3 bench/copy_interference.py 2>&1 | tee "$OUT/copy_interference.log" | tail -12 || rc=1
exit $rc
