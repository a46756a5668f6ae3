#!/usr/bin/env bash
# One device call, no vLLM: the connector-level figures (bench/gpu_connector.py), the RPC round
# trips (bench/rpc.py) and the public kv_ops call's host time (bench/kv_ops_host.py --cuda), each
# with the server and client spinning for replies (MARU_SERVER_SPIN_US / MARU_RPC_SPIN_US) and
# without. Results to $OUT: connector_spin{0,1}.json, *.log. Carry `.whl` (pyzmq).
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
for spin in 0 1; do
  if [ "$spin" = 1 ]; then export MARU_SERVER_SPIN_US=${SERVER_SPIN_US:-200} MARU_RPC_SPIN_US=${CLIENT_SPIN_US:-300}
  else export MARU_SERVER_SPIN_US=0 MARU_RPC_SPIN_US=0; fi
  echo "== spin server ${MARU_SERVER_SPIN_US} us, client ${MARU_RPC_SPIN_US} us"
  timeout 150 python3 bench/gpu_connector.py --json "$OUT/connector_spin$spin.json" 2>&1 | tee "$OUT/connector_spin$spin.log" | tail -8 || rc=1
  timeout 90 python3 bench/rpc.py --iterations 1000 --warmup 100 2>&1 | tee "$OUT/rpc_spin$spin.log" | grep -E '^\| (zmq|exists|lookup)' || rc=1
done
export MARU_SERVER_SPIN_US=0 MARU_RPC_SPIN_US=0
timeout 60 python3 bench/kv_ops_host.py --cuda 2>&1 | tee "$OUT/kv_ops_host.log" | tail -6 || rc=1
timeout 60 python3 bench/layer_issue.py 2>&1 | tee "$OUT/layer_issue.log" | tail -8 || rc=1
exit $rc
