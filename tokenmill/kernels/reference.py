"""Plain-torch references for every kernel: the CPU path, and the ground truth the Triton kernels are
tested against. Each Triton kernel in this package has the same signature as its reference here (the
quantized GEMMs' and their packing: quant_reference.py).

Paged KV cache layout, per layer: k_cache and v_cache of shape [num_blocks, block_size, num_kv_heads,
head_dim]. A token at position p of a request lives in slot block_table[p // block_size] * block_size +
p % block_size.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tokenmill.kernels import QuantizedRows, RowQuant, StepRotary

# e4m3, the FP8 of weights, activations and the KV cache alike, and its largest finite value (448).
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def as_stored_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x as an FP8 KV cache holds it and its readers see it: x / scale saturated to e4m3 and rounded, times
    scale, in x's dtype (the dense prefill attends over this, as the paged kernels over the cache)."""
    return ((x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * scale).to(x.dtype)


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
    cache (float8_e4m3fn) stores key / k_scale and value / v_scale, saturated to e4m3's range (+-448);
    other caches store the values as they are (their scales are 1)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.dtype == FP8_DTYPE:
        key = (key.float() / k_scale).clamp(-FP8_MAX, FP8_MAX)
        value = (value.float() / v_scale).clamp(-FP8_MAX, FP8_MAX)
    if bool((slot_mapping < 0).any()):
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    for cache, new in ((k_cache, key), (v_cache, value)):
        new = new.to(cache.dtype)
        if cache.dtype == FP8_DTYPE:  # index_copy_ has no fp8 kernel: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, new)


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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rotary: StepRotary | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged context.

    query [num_tokens, num_heads, head_dim] holds the new tokens of every request back to back
    (request b owns rows query_start_loc[b]:query_start_loc[b+1]). Request b's context is seq_lens[b]
    tokens, the last of which are its new tokens, so a prefill, a chunk of a prefill over a cached
    prefix and a decode step are the same call. The KV of the new tokens must already be written.
    max_query_len, max_seq_len, num_kv_splits and num_decodes are host-side hints for kernels that size
    their grid by them; this reference needs none. Padded requests (seq_len 0, query_len 0) are skipped,
    and rows of `out` that no request owns are left untouched. An FP8 cache holds K / k_scale and
    V / v_scale: its values are read exactly, k_scale folds into the softmax scale and v_scale into the
    output. With `rotary` the query and the step's key arrive unrotated: they are rotated and the step's
    key and value stored first (rotary_and_write_kv_cache; the query may be left rotated in place).
    """
    if rotary is not None:
        query, _ = rotary_and_write_kv_cache(
            rotary.positions, query, rotary.key, rotary.value, rotary.cos_sin_cache, k_cache, v_cache,
            rotary.slot_mapping, k_scale, v_scale,
        )  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    scale = scale * k_scale
    if max_query_len == 1 and num_tokens == seq_lens.shape[0]:
        return _batched_decode(query, k_cache, v_cache, block_tables, seq_lens, scale, out, v_scale)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        query_len = q_end - q_start
        if query_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        k, v = _context(k_cache, v_cache, block_tables[b, :num_blocks], seq_len)
        q = query[q_start:q_end]
        # Query i sits at position seq_len - query_len + i and sees keys at positions <= its own.
        # Batched (4-D) inputs: with 3-D ones the CPU dispatcher falls back to the math kernel, which
        # materialises every score (6x slower at 2k tokens) instead of its flash kernel.
        dtype = _attention_dtype(query.dtype)
        q4, k4, v4 = (t.transpose(0, 1)[None].to(dtype) for t in (q, k, v))
        if 1 < query_len < seq_len and _CPU_FLASH is not None and q.device.type == "cpu":
            attn = _chunk_over_prefix(q4, k4, v4, seq_len - query_len, scale)
        else:
            mask = _chunk_mask(seq_len, query_len, q.device) if 1 < query_len < seq_len else None
            attn = F.scaled_dot_product_attention(
                q4, k4, v4, attn_mask=None if mask is None else mask[None, None],
                is_causal=query_len == seq_len, scale=scale, enable_gqa=num_heads != num_kv_heads,
            )  # fmt: skip
        if v_scale != 1.0:
            attn = attn * v_scale
        out[q_start:q_end] = attn[0].transpose(0, 1).to(out.dtype)
    return out


def _context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's keys and values [seq_len, kv_heads, head_dim]. Blocks that follow each other in the
    cache (a long prompt's usually do: the allocator hands out free blocks in order) are read in place;
    others are gathered, a copy of the whole context in every layer of every chunk."""
    if bool((blocks.diff() == 1).all()):
        first, num_blocks = int(blocks[0]), blocks.shape[0]
        k, v = k_cache[first : first + num_blocks], v_cache[first : first + num_blocks]
    else:
        index = blocks.long()
        k, v = k_cache.index_select(0, index), v_cache.index_select(0, index)
    return k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]


# The CPU flash-attention op behind F.scaled_dot_product_attention, which also returns each query's
# log-sum-exp of scores (a private aten op; None where this torch lacks it).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _chunk_over_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float
) -> torch.Tensor:
    """A prompt chunk [1, heads, Lq, D] over its cached prefix and itself (k, v [1, kv_heads, S, D]) as
    two mask-free flash attentions, the prefix (every query sees all of it) and the chunk (causal),
    merged by their log-sum-exps. On a CPU this is 1.4x faster than one call with a [Lq, S] mask (512
    queries over 8k keys, bf16), which the kernel reads and applies in every tile."""
    out_p, lse_p = _CPU_FLASH(q, k[:, :, :prefix_len], v[:, :, :prefix_len], 0.0, False, scale=scale)
    out_c, lse_c = _CPU_FLASH(q, k[:, :, prefix_len:], v[:, :, prefix_len:], 0.0, True, scale=scale)
    lse = torch.logaddexp(lse_p, lse_c)
    weight_p, weight_c = torch.exp(lse_p - lse)[..., None], torch.exp(lse_c - lse)[..., None]
    return (out_p.float() * weight_p + out_c.float() * weight_c).to(q.dtype)


@functools.lru_cache(maxsize=4)
def _chunk_mask(seq_len: int, query_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] True where the chunk's query i (at position seq_len - query_len + i) may see
    key j: built once per chunk shape, not in each of the model's layers."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def _batched_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """One query token per request: gather every context into one padded batch and attend once,
    instead of once per request (the CPU decode path's cost is per call, not per byte)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    index = _decode_gather_index(block_tables, seq_lens, block_size, k_cache.shape[0])
    if index is None:
        return out
    slots, valid, rows = index
    dtype = _attention_dtype(query.dtype)
    k = _gather_slots(k_cache, slots).transpose(1, 2).to(dtype)
    v = _gather_slots(v_cache, slots).transpose(1, 2).to(dtype)
    attn = F.scaled_dot_product_attention(
        query[:, :, None, :].to(dtype),
        k,
        v,
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    if v_scale != 1.0:
        attn = attn * v_scale
    if rows is None:
        out.copy_(attn[:, :, 0, :])
    else:
        out[rows] = attn[:, :, 0, :].to(out.dtype)[rows]
    return out


def _gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [blocks, block_size, heads, dim] read at slots [B, S] -> [B, S, heads, dim]. index_select
    over the flattened slots, not cache[slots]: advanced indexing took 5x as long on a CPU (129 vs 25 us
    for 16 requests x 200 tokens of SmolLM2's KV)."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[2:])


def _decode_gather_index(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Per request and context position, the cache slot to read and whether it is real, and which
    requests have a context (None when all do). None when no request has a context. Every layer of a
    step asks with equal tables and lengths: the last answer is kept and reused while they compare
    equal (two small comparisons instead of rebuilding the index in each of 30 layers)."""
    cached = _last_decode_index.get((block_size, num_blocks))
    if (
        cached is not None
        and cached[0].shape == block_tables.shape
        and cached[1].shape == seq_lens.shape
        and torch.equal(cached[0], block_tables)
        and torch.equal(cached[1], seq_lens)
    ):
        return cached[2]
    length = int(seq_lens.max()) if seq_lens.numel() else 0
    index = None
    if length:
        positions = torch.arange(length, device=seq_lens.device)
        valid = positions[None, :] < seq_lens[:, None]
        # Padding positions read the request's own first token: a written slot, so a finite value,
        # which the mask then drops. (Slots past a request's length may hold anything, NaN and inf
        # included, and a masked NaN would still poison the weighted sum as 0 * NaN.) Padded requests
        # (seq_len 0) read block 0 and are dropped by the caller.
        positions = torch.where(valid, positions[None, :], 0)
        blocks = block_tables.long().clamp(0, num_blocks - 1)
        slots = blocks.gather(1, positions // block_size) * block_size + positions % block_size
        rows = seq_lens > 0
        index = (slots, valid, None if bool(rows.all()) else rows)
    _last_decode_index.clear()
    _last_decode_index[(block_size, num_blocks)] = (block_tables.clone(), seq_lens.clone(), index)
    return index


# The batched decode's last gather index, with the tables and lengths it was built from.
_last_decode_index: dict[tuple[int, int], tuple] = {}


def _attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """SDPA runs in fp32 and bf16 as they are (bf16 accumulates in fp32 inside the kernel, as in
    transformers' own bf16 attention; 2.5x faster than fp32 on a CPU with AMX); fp16 goes through fp32,
    which CPUs without fp16 arithmetic would otherwise emulate."""
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _resolved(x):
    """x, or the output a ScaledRows (a W8A8 product with its scales not yet applied) stands for: every
    reference takes one where its Triton namesake does."""
    from tokenmill.kernels import resolved

    return resolved(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as transformers does."""
    x = _resolved(x)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x, then RMSNorm of the sum; returns (normed, new residual)."""
    residual = _resolved(x) + residual
    return rms_norm(residual, weight, eps), residual


def rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, quant: RowQuant
) -> tuple[QuantizedRows, torch.Tensor | None]:
    """RMSNorm of x (of residual + x, with a residual), its output quantized a row at a time as `quant`
    asks: (the quantized rows, the new residual or None)."""
    if residual is None:
        normed, residual_out = rms_norm(x, weight, eps), None
    else:
        normed, residual_out = fused_add_rms_norm(x, residual, weight, eps)
    return quantize_rows(normed, quant), residual_out


def quantize_rows(x: torch.Tensor, quant: RowQuant) -> QuantizedRows:
    """x [..., K] quantized a row at a time by quant's own function."""
    from tokenmill.kernels import QuantizedRows

    values, scale = quant.quantize(x.reshape(-1, x.shape[-1]), quant.static_scale)
    return QuantizedRows(values, scale, x.shape, x.dtype)


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
    """rotary_embedding, then write_kv_cache of the rotated key and the value; returns the rotated
    (query, key). One launch on the GPU (kernels/rotary.py)."""
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return query, key


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = gate || up  ->  silu(gate) * up, [T, I]."""
    gate, up = _resolved(x).chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_quant(x: torch.Tensor, quant: RowQuant) -> QuantizedRows:
    """silu_and_mul's output quantized a row at a time as `quant` asks."""
    return quantize_rows(silu_and_mul(x), quant)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE router: logits [T, E] -> each token's top_k experts [T, k] (largest first) and their
    weights [T, k] in the logits' dtype: the softmax over all experts in fp32, the k largest kept,
    rescaled to sum to 1 when renormalize."""
    weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(logits.dtype)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Mixture of experts: x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; each token's
    experts and routing weights [T, k] (weights in x's dtype) -> [T, H], the sum over its k experts of
    weight * w2 @ silu_and_mul(w13 @ x). An expert id of E means no expert here (another rank's, under
    expert parallelism): that pair adds nothing. Per expert that received tokens: gather, MLP, scale,
    add back (shapes follow the routing: a host sync, no CUDA graph). w13 and w2 may be quantized
    (quant_reference.QuantExperts): each expert that received tokens is dequantized into x's dtype."""
    top_k = experts.shape[1]
    out = torch.zeros_like(x)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()[: w13.shape[0]]
    tokens, pair_weights = order // top_k, weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start : start + count]
        gate_up, down = (
            w[expert] if isinstance(w, torch.Tensor) else w.one(expert, x.dtype) for w in (w13, w2)
        )
        hidden = silu_and_mul(F.linear(x[rows], gate_up))
        out.index_add_(0, rows, F.linear(hidden, down) * pair_weights[start : start + count, None])
        start += count
    return out


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor | None, seed: int) -> torch.Tensor:
    """kernels/sample.py's one-launch sampling in torch: int64 [B], where temperature [B] > 0 the argmax
    of logits / temperature plus Gumbel noise (a draw from softmax(logits / temperature)), else the first
    index of the row's largest logit. The same distribution as the kernel's, from torch's own generator
    seeded with `seed` (not the kernel's Philox counters: the same seed gives other draws)."""
    x = logits.float()
    greedy = x.argmax(dim=-1)
    if temperature is None:
        return greedy
    generator = torch.Generator(device=logits.device).manual_seed(seed)
    u = torch.rand(x.shape, generator=generator, device=logits.device)
    positive = temperature > 0
    inv_t = 1.0 / torch.where(positive, temperature, 1.0)
    drawn = (x * inv_t[:, None] - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(positive, drawn, greedy)
