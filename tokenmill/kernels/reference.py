"""Plain-torch references for every kernel: the CPU path, and the ground truth the Triton kernels are
tested against. Each Triton kernel in this package has the same signature as its reference here.

Paged KV cache layout, per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A token at position p of a request lives in slot block_table[p // block_size] * block_size +
p % block_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [num_tokens, num_kv_heads, head_dim] at their slots; slot -1 is padding."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = value[valid].to(v_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    num_decodes: int = 0,
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged context.

    query [num_tokens, num_heads, head_dim] holds the new tokens of every request back to back
    (request b owns rows query_start_loc[b]:query_start_loc[b+1]). Request b's context is seq_lens[b]
    tokens, the last of which are its new tokens, so a prefill, a chunk of a prefill over a cached
    prefix and a decode step are the same call. The KV of the new tokens must already be written.
    max_query_len, max_seq_len, num_kv_splits and num_decodes are host-side hints for kernels that size
    their grid by them; this reference needs none. Padded requests (seq_len 0, query_len 0) are skipped,
    and rows of `out` that no request owns are left untouched.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    if max_query_len == 1 and num_tokens == seq_lens.shape[0]:
        return _batched_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, out)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[b, :num_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        q = query[q_start:q_end]
        # Query i sits at position seq_len - query_len + i and sees keys at positions <= its own.
        mask, is_causal = None, False
        if query_len == seq_len:
            is_causal = True
        elif query_len > 1:
            q_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        # Batched (4-D) inputs: with 3-D ones the CPU dispatcher falls back to the math kernel, which
        # materialises every score (6x slower at 2k tokens) instead of its flash kernel.
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(),
            k.transpose(0, 1)[None].float(),
            v.transpose(0, 1)[None].float(),
            attn_mask=None if mask is None else mask[None, None],
            is_causal=is_causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[q_start:q_end] = attn[0].transpose(0, 1).to(out.dtype)
    return out


def _batched_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """One query token per request: gather every context into one padded batch and attend once,
    instead of once per request (the CPU decode path's cost is per call, not per byte)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    # Table entries past a request's blocks may be stale or garbage: any valid id will do, it is masked.
    blocks = block_tables.long().clamp(0, k_cache.shape[0] - 1)
    k = k_cache[blocks].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache[blocks].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # Padded requests (seq_len 0) see nothing: their rows of `out` are left untouched.
    valid = torch.arange(k.shape[2], device=query.device)[None, :] < seq_lens[:, None]
    # Padding keys and values are zeroed, not just masked: uninitialised slots may hold NaN or inf,
    # which would poison the scores (NaN + -inf) and the weighted sum (0 * NaN).
    keep = valid[:, None, :, None]
    k = torch.where(keep, k.float(), 0.0)
    v = torch.where(keep, v.float(), 0.0)
    attn = F.scaled_dot_product_attention(
        query[:, :, None, :].float(),
        k,
        v,
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    rows = seq_lens > 0
    out[rows] = attn[:, :, 0, :].to(out.dtype)[rows]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as transformers does."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then RMSNorm of the sum; returns (normed, new residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary on query [T, Hq, D] and key [T, Hkv, D].

    cos_sin_cache [max_position, D] holds cos in its first D/2 columns and sin in the last D/2.
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = gate || up  ->  silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
