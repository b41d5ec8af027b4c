"""Triton neox-style (rotate-half) rotary embedding, applied in place to query and key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x,
    stride_head,
    cos,
    sin,
    cols,
    col_ok,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF_DIM: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads < NUM_HEADS)[:, None] & col_ok[None, :]
    first = x + heads[:, None] * stride_head + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF_DIM, mask=mask, other=0.0)
    x1_32 = x1.to(tl.float32)
    x2_32 = x2.to(tl.float32)
    tl.store(first, (x1_32 * cos - x2_32 * sin).to(x1.dtype), mask=mask)
    tl.store(first + HALF_DIM, (x2_32 * cos + x1_32 * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions,
    query,
    key,
    cos_sin_cache,
    stride_query_tok,
    stride_query_head,
    stride_key_tok,
    stride_key_head,
    stride_cache_pos,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_DIM: tl.constexpr,
    HALF_DIM_PAD: tl.constexpr,
):
    """One program per token: its cos/sin row is read once for every query and key head."""
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + tok).to(tl.int64)
    cols = tl.arange(0, HALF_DIM_PAD)
    col_ok = cols < HALF_DIM
    cos = tl.load(cos_sin_cache + pos * stride_cache_pos + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cache_pos + HALF_DIM + cols, mask=col_ok, other=0.0)
    sin = sin.to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    _rotate_heads(
        query + tok * stride_query_tok,
        stride_query_head,
        cos,
        sin,
        cols,
        col_ok,
        NUM_Q_HEADS,
        Q_HEADS_PAD,
        HALF_DIM,
    )
    _rotate_heads(
        key + tok * stride_key_tok,
        stride_key_head,
        cos,
        sin,
        cols,
        col_ok,
        NUM_KV_HEADS,
        KV_HEADS_PAD,
        HALF_DIM,
    )


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on query [T, Hq, D] and key [T, Hkv, D], written in place; returns them.

    cos_sin_cache [max_position, D] holds cos in its first D/2 columns and sin in the last D/2.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if query.stride(2) != 1 or key.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension on query, key and cache")
    if num_tokens == 0:
        return query, key
    half_dim = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_DIM=half_dim, HALF_DIM_PAD=triton.next_power_of_2(half_dim), num_warps=4,
    )  # fmt: skip
    return query, key
