"""How LMCache's vLLM layout detection reads vLLM's packed FlashAttention cache (CPU, no GPU needed).

vLLM >= 0.26 hands connectors each layer's cache as ``[NB, NH, BS, 2*HS]`` (logical, head-major)
over NHD memory (``[NB, BS, NH, 2*HS]``). LMCache's detector maps a 4-D cache with the NHD hint to
its ``NL_X_NB_BS_NH_CS`` format and reads axis 1 as the block size and axis 2 as the heads, i.e.
swapped whenever block size != KV heads. Prints what it reads. Usage (lmcache installed):

    python bench/lmcache_layout_probe.py [--block-size 16] [--kv-heads 8]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    a = ap.parse_args()
    import lmcache
    import lmcache.v1.gpu_connector.kv_format.detectors.vllm as det
    from lmcache.v1.gpu_connector.kv_format.specs.nl_x_nb_bs_nh_cs import NL_X_NB_BS_NH_CS_Spec

    det.torch_device_type = "cuda"  # the detector forces HND on a CPU host; ask what it does on a GPU
    nb, bs, nh, hs = 64, a.block_size, a.kv_heads, a.head_size
    layer = torch.zeros(nb, bs, nh, 2 * hs).permute(0, 2, 1, 3)  # vLLM's logical shape over NHD memory
    fmt, caches = det.VLLM_Detector().discover([layer, layer], {"kv_layout": "NHD"})
    spec = NL_X_NB_BS_NH_CS_Spec.__new__(NL_X_NB_BS_NH_CS_Spec)
    spec.kv_caches = caches
    print(f"lmcache {lmcache.__version__}; vLLM cache shape {tuple(layer.shape)} strides {layer.stride()}")
    print(f"detected {fmt}")
    print(
        f"LMCache reads block_size={spec.block_size()} num_heads={spec.num_heads()} "
        f"(true: block_size={bs} num_heads={nh}): {'right' if spec.block_size() == bs else 'SWAPPED'}"
    )


if __name__ == "__main__":
    main()
