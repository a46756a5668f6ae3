# Sourced (not run) by the bench/*pass*.sh scripts on the device machine: repo root as the working
# directory, unbuffered Python, $OUT for logs, and the carried wheels (`.whl/`, e.g. pyzmq: the
# device has no network) installed into /tmp/wheels and put on PYTHONPATH with the repo. Not into
# /tmp/site: the vLLM bundle unpacks there with a pyzmq of its own, and two pyzmq versions in one
# folder break both ("zmq.backend.cython has no attribute PYZMQ_DRAFT_API", 2026-12-05); /tmp/site
# comes first on the path once it exists.
# Usage: source "$(dirname "$0")/device_env.sh" || exit 1
cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1
export PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/wheels .whl/*.whl \
    || { echo "device_env: installing the carried wheels (.whl/) failed" >&2; return 1; }
  export PYTHONPATH="/tmp/wheels:$PWD"
fi
if [ -d /tmp/site ]; then
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
true
