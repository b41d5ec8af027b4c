"""Where a KV cache block's bytes lie (TOKENMILL_KV_LAYOUT). The cache tensor's shape is [block, slot,
KV head, dim] either way, and the GPU kernels read and write it through its strides:

- "nhd", token-major as the shape reads: a slot's heads side by side (the default);
- "hnd", head-major: a KV head's slots of a block side by side (FlashInfer's HND), so a decode's reads of
  one KV head are whole runs of a block instead of pieces of head_dim values one slot apart.

Offload and disaggregation move blocks as logical rows (kv_offload.BlockRows), the same bytes from either
layout. The CPU's reference path views the cache flat by slots: "nhd" only there."""

from __future__ import annotations

import os

import torch

ENV = "TOKENMILL_KV_LAYOUT"
LAYOUTS = ("nhd", "hnd")


def kv_cache_layout(device: torch.device) -> str:
    """The layout TOKENMILL_KV_LAYOUT asks for on `device`; a ValueError naming the variable for an
    unknown one, or for "hnd" off a CUDA device."""
    layout = os.environ.get(ENV, "nhd")
    if layout not in LAYOUTS:
        raise ValueError(f"{ENV}={layout!r}: give one of {LAYOUTS}")
    if layout == "hnd" and device.type != "cuda":
        raise ValueError(f"{ENV}=hnd needs a CUDA device (the CPU path reads the cache token-major)")
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
