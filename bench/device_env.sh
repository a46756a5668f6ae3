# Sourced (not run) by the bench/*pass*.sh scripts on the device machine: repo root as the working
# directory, unbuffered Python, $OUT for logs, and the carried wheels (`.whl/`, e.g. pyzmq: the
# device has no network) installed into /tmp/site and put on PYTHONPATH with the repo.
# Usage: source "$(dirname "$0")/device_env.sh" || exit 1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
export PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_env: installing the carried wheels (.whl/) failed" >&2; return 1; }
  export PYTHONPATH="/tmp/site:$PWD"
fi
