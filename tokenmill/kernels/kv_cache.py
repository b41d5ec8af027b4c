"""Triton store of new keys and values into the paged KV cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key,
    value,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    """One program per token: all its KV heads at once. FP8: store x / scale, saturated to e4m3's range."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + tok).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    cache_offsets = (
        (slot // KV_BLOCK_SIZE) * stride_cache_block
        + (slot % KV_BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(key + tok * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    v = tl.load(
        value + tok * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(k_cache + cache_offsets, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + cache_offsets, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots; slot -1 is padding. An FP8
    cache stores key / k_scale and value / v_scale, saturated to e4m3's range."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    heads_pad = triton.next_power_of_2(num_kv_heads)
    head_dim_pad = triton.next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=heads_pad, HEAD_DIM_PAD=head_dim_pad,
        KV_BLOCK_SIZE=k_cache.shape[1], FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=4 if heads_pad * head_dim_pad >= 1024 else 1,
    )  # fmt: skip
