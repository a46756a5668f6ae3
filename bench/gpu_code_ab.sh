#!/usr/bin/env bash
# A code A/B at the connector level, in one device call: bench/gpu_connector.py run from this tree
# ("after") and from an earlier commit's tree in .ab/before ("before"; this tree's bench files
# copied over it, so both sides measure alike), alternated ROUNDS times (a host's speed drifts over
# minutes). A table of the held layer load last (bench/code_ab_table.py).
# Make the before tree first (here, before the device call; .ab/ travels with the working tree):
#   rm -rf .ab && mkdir -p .ab && git archive <commit> | tar -x -C .ab --one-top-level=before
# Usage (device machine, repo root): ROUNDS=2 REPS=20 SIZES=256,16384 bash bench/gpu_code_ab.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh" || exit 1
ROUNDS="${ROUNDS:-2}"
REPS="${REPS:-20}"
SIZES="${SIZES:-256,16384}"
[ -d .ab/before/maru ] || { echo "gpu_code_ab: no .ab/before tree (see the header)" >&2; exit 1; }
cp bench/*.py .ab/before/bench/
# The bench imports tests.helpers (the server process): this tree's, where the before tree was
# carried without its tests (the device tool carries 64 MiB at most, the vLLM pieces 47 of it).
[ -d .ab/before/tests ] || cp -r tests .ab/before/
here="$PWD"
for r in $(seq 1 "$ROUNDS"); do
  for side in before after; do
    dir="$here"
    [ "$side" = before ] && dir="$here/.ab/before"
    (cd "$dir" && PYTHONPATH="${PYTHONPATH/$here/$dir}" timeout 200 python3 bench/gpu_connector.py \
      --sizes "$SIZES" --load-reps "$REPS" --json "$OUT/code_ab_${side}_${r}.json") \
      > "$OUT/code_ab_${side}_${r}.log" 2>&1 || echo "code A/B: $side, round $r failed (see code_ab_${side}_${r}.log)"
  done
done
python3 bench/code_ab_table.py "$OUT"
