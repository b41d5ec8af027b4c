"""Where a KV cache block's bytes lie (TOKENMILL_KV_LAYOUT). The cache tensor's shape is [block, slot,
KV head, dim] either way, and the GPU kernels read and write it through its strides:

- "nhd", token-major as the shape reads: a slot's heads side by side;
- "hnd", head-major: a KV head's slots of a block side by side (FlashInfer's HND), so a decode's reads of
  one KV head are whole runs of a block instead of pieces of head_dim values one slot apart;
- "auto" (the default): head-major for an FP8 cache under the GPU kernels, token-major otherwise. On an H200
  (forty-ninth session, docs/performance.md) the CUDA FP8 decode at 16 x 32k took 272.6-275.0 us a layer
  over head-major pages against 290.1-292.1 token-major (3.94 against 3.70 TB/s) and the 32k step 13.32
  against 13.76 ms; the bf16 Triton decode 540.4 against 543.9 us, its step 21.07 against 20.75 ms (one
  run each): level, so a 16-bit cache stays token-major.

Offload and disaggregation move blocks as logical rows (kv_offload.BlockRows), the same bytes from either
layout. The torch reference kernels (the CPU's, or TOKENMILL_ATTENTION_BACKEND=torch) view the cache flat by
slots: "nhd" only there."""

from __future__ import annotations

import os

import torch

from tokenmill.kernels import get_kernels

ENV = "TOKENMILL_KV_LAYOUT"
LAYOUTS = ("auto", "nhd", "hnd")


def kv_cache_layout(device: torch.device, dtype: torch.dtype) -> str:
    """The layout ("nhd" or "hnd") of a `dtype` cache on `device`, as TOKENMILL_KV_LAYOUT asks; a ValueError
    naming the variable for an unknown one, or for "hnd" where the torch reference kernels run."""
    layout = os.environ.get(ENV, "auto")
    if layout not in LAYOUTS:
        raise ValueError(f"{ENV}={layout!r}: give one of {LAYOUTS}")
    gpu_kernels = device.type == "cuda" and get_kernels(device).backend == "triton"
    if layout == "hnd" and not gpu_kernels:
        raise ValueError(
            f"{ENV}=hnd needs a CUDA device and its Triton kernels (the torch reference kernels read the "
            "cache token-major)"
        )
    if layout == "auto":
        return "hnd" if gpu_kernels and dtype.itemsize == 1 else "nhd"
    return layout


def empty_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, layout: str = "nhd",
) -> torch.Tensor:  # fmt: skip
    """An uninitialised cache tensor [num_blocks, block_size, num_kv_heads, head_dim] whose bytes lie in
    `layout`."""
    if layout == "hnd":
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        return torch.empty(shape, dtype=dtype, device=device).permute(0, 2, 1, 3)
    return torch.empty((num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
