#!/usr/bin/env bash
# The fused load checksum's A/B at the connector level, in one device call: bench/gpu_connector.py
# at 256 and 2048 tokens without and with --fused (MARU_FUSED_LOAD_CHECKSUM=1), alternated ROUNDS
# times (one host's speed drifts over minutes: alternation keeps the two sides comparable); a table
# of the held load's share of pinned bandwidth (the target: >= 85% at 256 tokens) last.
# Usage (device machine, repo root): ROUNDS=3 REPS=30 bash bench/gpu_fused_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
ROUNDS="${ROUNDS:-3}"
REPS="${REPS:-30}"
for r in $(seq 1 "$ROUNDS"); do
  for mode in separate fused; do
    flag=""
    [ "$mode" = fused ] && flag="--fused"
    timeout 170 python3 bench/gpu_connector.py --sizes 256,2048 --load-reps "$REPS" $flag \
      --json "$OUT/fused_ab_${mode}_${r}.json" > "$OUT/fused_ab_${mode}_${r}.log" 2>&1 \
      || echo "fused A/B: $mode, round $r failed (see fused_ab_${mode}_${r}.log)"
  done
done
python3 bench/fused_ab_table.py "$OUT"
