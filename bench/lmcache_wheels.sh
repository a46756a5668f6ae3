#!/usr/bin/env bash
# Download, on a machine with network, the wheels LMCache needs on the H200 machine (Python 3.12,
# manylinux x86_64; no network there) into .whl/lmcache/ (git-ignored), for bench/gpu_lmcache_pass.sh.
#   bash bench/lmcache_wheels.sh            # from the repo root; prints the total size
# What and why (the vLLM 0.26 bundle, ../shared/tools/gpu-vllm, brings vLLM's own dependencies):
#   lmcache 0.5.6 (newest) and 0.5.3 (the newest whose compiled ops resolve against torch 2.11; 0.5.4-0.5.6
#     miss a c10 symbol), both --no-deps: their declared
#     dependencies include cupy-cuda13x, cuda-python, grpcio, google-cloud-bigtable, ..., none of
#     which the in-process vLLM connector + storage-plugin path imports;
#   aiofile + caio, sortedcontainers: imported on that path, not in the vLLM bundle.
# Not included: numba (its llvmlite wheel alone is 57 MiB). LMCache imports it only to compile CPU
#   codec kernels (cachegen, the multiprocess token hasher) that this path never calls;
#   bench/lmcache_shim/ stands in for it when it is missing (gpu_lmcache_pass.sh says so).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl/lmcache
rm -rf "$dest" && mkdir -p "$dest"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
for spec in lmcache==0.5.6 lmcache==0.5.3; do
  v=${spec#lmcache==}
  mkdir -p "$dest/$v"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$dest/$v" "$spec"
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$dest" "aiofile==3.12.3" "caio==0.12.10" "sortedcontainers==2.4.0"
find "$dest" -name '*.whl' -printf '%8k KiB  %P\n' | sort -k3
echo "total: $(du -sb "$dest" | awk '{printf "%.1f MiB", $1 / 1048576}') in $dest"
