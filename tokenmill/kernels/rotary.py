"""Triton neox-style (rotate-half) rotary embedding, applied in place to query and key; and the same
fused with the store of the rotated keys and the values into the paged KV cache (one launch per layer
instead of two: at batch 1 each is a few microseconds of launch for a few kilobytes of work)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import pdl


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
    y1 = (x1_32 * cos - x2_32 * sin).to(x1.dtype)
    y2 = (x2_32 * cos + x1_32 * sin).to(x1.dtype)
    tl.store(first, y1, mask=mask)
    tl.store(first + HALF_DIM, y2, mask=mask)
    return y1, y2, heads, mask


@triton.jit
def _rotary_kernel(
    positions,
    query,
    key,
    value,
    cos_sin_cache,
    k_cache,
    v_cache,
    slot_mapping,
    k_scale,
    v_scale,
    stride_query_tok,
    stride_query_head,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_pos,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF_DIM: tl.constexpr,
    HALF_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    """One program per token, its cos/sin row read once for every head: query and key rotated in place;
    with WRITE_KV the rotated key and the value are then stored at the token's slot (none for slot -1,
    padding). FP8: stored as x / scale, saturated to e4m3. EARLY (pdl.EARLY_READS): the position, its
    cos/sin row and the slot are read before the PDL wait (no kernel of the step writes them)."""
    if not EARLY:
        pdl.start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + tok).to(tl.int64)
    cols = tl.arange(0, HALF_DIM_PAD)
    col_ok = cols < HALF_DIM
    cos = tl.load(cos_sin_cache + pos * stride_cache_pos + cols, mask=col_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_cache + pos * stride_cache_pos + HALF_DIM + cols, mask=col_ok, other=0.0)
    cos, sin = cos[None, :], sin.to(tl.float32)[None, :]
    if WRITE_KV:
        slot = tl.load(slot_mapping + tok).to(tl.int64)
    else:
        slot = -1
    if EARLY:
        pdl.start(PDL)
    _rotate_heads(
        query + tok * stride_query_tok, stride_query_head, cos, sin, cols, col_ok,
        NUM_Q_HEADS, Q_HEADS_PAD, HALF_DIM,
    )  # fmt: skip
    k1, k2, heads, mask = _rotate_heads(
        key + tok * stride_key_tok, stride_key_head, cos, sin, cols, col_ok,
        NUM_KV_HEADS, KV_HEADS_PAD, HALF_DIM,
    )  # fmt: skip
    if not WRITE_KV:
        return
    if slot < 0:
        return
    first_v = value + tok * stride_value_tok + heads[:, None] * stride_value_head + cols[None, :]
    v1 = tl.load(first_v, mask=mask)
    v2 = tl.load(first_v + HALF_DIM, mask=mask)
    if FP8:
        k1 = tl.clamp(k1.to(tl.float32) / k_scale, -448.0, 448.0)
        k2 = tl.clamp(k2.to(tl.float32) / k_scale, -448.0, 448.0)
        v1 = tl.clamp(v1.to(tl.float32) / v_scale, -448.0, 448.0)
        v2 = tl.clamp(v2.to(tl.float32) / v_scale, -448.0, 448.0)
    cache_offsets = (
        (slot // KV_BLOCK_SIZE) * stride_cache_block
        + (slot % KV_BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + cols[None, :]
    )
    tl.store(k_cache + cache_offsets, k1.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(k_cache + cache_offsets + HALF_DIM, k2.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + cache_offsets, v1.to(v_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + cache_offsets + HALF_DIM, v2.to(v_cache.dtype.element_ty), mask=mask)


def _launch(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            write_kv: bool) -> None:  # fmt: skip
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half_dim = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HALF_DIM=half_dim, HALF_DIM_PAD=triton.next_power_of_2(half_dim), KV_BLOCK_SIZE=k_cache.shape[1],
        FP8=k_cache.dtype == torch.float8_e4m3fn, WRITE_KV=write_kv, EARLY=pdl.EARLY_READS, num_warps=4,
        **pdl.launch_args(query),
    )  # fmt: skip


def rotary_and_write_kv_cache(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding (in place), then write_kv_cache of the rotated key and the value, in one launch;
    returns (query, key). value [T, Hkv, D] may be strided along its tokens."""
    if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_and_write_kv_cache needs a contiguous last dimension on its tensors")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    if query.shape[0]:
        _launch(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                write_kv=True)  # fmt: skip
    return query, key


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary on query [T, Hq, D] and key [T, Hkv, D], written in place; returns them.

    cos_sin_cache [max_position, D] holds cos in its first D/2 columns and sin in the last D/2.
    """
    if query.stride(2) != 1 or key.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("rotary_embedding needs a contiguous last dimension on query, key and cache")
    if query.shape[0]:
        # No cache to write: the key stands in for the value and for both caches, never touched.
        unused = key[:, None]
        _launch(
            positions, query, key, key, cos_sin_cache, unused, unused, positions, 1.0, 1.0, write_kv=False
        )
    return query, key
