"""Triton paged attention over the paged KV cache: prefill, chunked prefill and decode in one kernel,
with query heads of a KV group packed into one tensor-core tile and split-KV for long decodes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels import pdl, sm_count
from tokenmill.kernels.split_kv import default_num_kv_splits, merge_splits

# exp2 is cheaper than exp on the GPU; folding log2(e) into the scale makes the two agree.
_LOG2_E = 1.4426950408889634


class TileConfig(NamedTuple):
    """Tile shape and launch options of one attention kernel launch."""

    block_m: int  # rows of the query tile: query tokens x heads of one KV group
    block_n: int  # keys per step of the KV loop
    num_warps: int
    num_stages: int


@triton.jit
def _find_seq(query_start_loc, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """The request owning query tile `tile_id`. Request b's tiles are numbered from
    query_start_loc[b] // BLOCK_Q + b: no prefix sum over tile counts is needed, at the price of at most
    one unused number per request, whose program finds no query rows and exits."""
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _attend_kv_range(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    k_cache,
    v_cache,
    block_table,
    kv_head_offset,
    kv_lo,
    kv_hi,
    qk_scale,
    stride_cache_block,
    stride_cache_slot,
    dims,
    dim_ok,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    PAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with keys kv_lo..kv_hi read through the block table.
    Without CAUSAL_MASK every key of the range is visible to every row and in bounds."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + offs_n
        if CAUSAL_MASK:
            key_ok = k_pos < kv_hi
            page = tl.load(block_table + k_pos // KV_BLOCK_SIZE, mask=key_ok, other=0)
            kv_mask = key_ok[:, None]
            if PAD_DIM:
                kv_mask = kv_mask & dim_ok[None, :]
            kv_other = 0.0
        else:
            page = tl.load(block_table + k_pos // KV_BLOCK_SIZE)
            kv_mask = None
            kv_other = None
            if PAD_DIM:
                kv_mask = dim_ok[None, :]
                kv_other = 0.0
        slot_offset = (
            page.to(tl.int64) * stride_cache_block
            + (k_pos % KV_BLOCK_SIZE) * stride_cache_slot
            + kv_head_offset
        )
        kv_offsets = slot_offset[:, None] + dims[None, :]
        k = tl.load(k_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL_MASK:
            visible = (k_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _split_range(kv_end, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [kv_lo, kv_hi) of split `split` of a query tile that sees keys [0, kv_end): whole tiles of
    BLOCK_N keys, the last split's range cut at kv_end (empty splits: kv_lo >= kv_hi)."""
    if NUM_SPLITS > 1:
        split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(kv_lo + split_len, kv_end)
    else:
        kv_lo = 0
        kv_hi = kv_end
    return kv_lo, kv_hi


@triton.jit
def _kv_tile_offsets(block_table, kv_head_offset, k_pos, key_ok, dims, stride_cache_block,
                     stride_cache_slot, KV_BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Offsets into the cache of keys k_pos (through the block table; 0 where not key_ok), [keys, dims]."""
    page = tl.load(block_table + k_pos // KV_BLOCK_SIZE, mask=key_ok, other=0)
    slot_offset = (
        page.to(tl.int64) * stride_cache_block + (k_pos % KV_BLOCK_SIZE) * stride_cache_slot + kv_head_offset
    )
    return slot_offset[:, None] + dims[None, :]


@triton.jit
def _early_kv_tile(
    k_cache, v_cache, block_tables, seq, seq_len, context_len, kv_head, split, stride_block_table,
    stride_cache_block, stride_cache_slot, stride_cache_head, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """A decode's first tile of keys and values in its split, as the cache holds them before this step:
    the context's keys only (earlier steps wrote them), zeros elsewhere."""
    kv_lo, kv_hi = _split_range(seq_len, split, NUM_SPLITS, BLOCK_N)
    k_pos = kv_lo + tl.arange(0, BLOCK_N)
    key_ok = (k_pos < kv_hi) & (k_pos < context_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    offsets = _kv_tile_offsets(
        block_tables + seq.to(tl.int64) * stride_block_table, kv_head.to(tl.int64) * stride_cache_head,
        k_pos, key_ok, dims, stride_cache_block, stride_cache_slot, KV_BLOCK_SIZE,
    )  # fmt: skip
    mask = key_ok[:, None] & (dims < HEAD_DIM)[None, :]
    return tl.load(k_cache + offsets, mask=mask, other=0.0), tl.load(v_cache + offsets, mask=mask, other=0.0)


@triton.jit
def _attend_early_tile(
    acc, m_i, l_i, q, first_k, first_v, k_cache, v_cache, block_table, kv_head_offset, kv_lo, kv_hi,
    context_len, qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
    KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The online-softmax update of a decode's first tile (keys kv_lo.. of its split, read by
    _early_kv_tile), with this step's keys and values (positions context_len..kv_hi) read now. A decode
    row sees every key before kv_hi; an empty split leaves (acc, m_i, l_i) as they were."""
    k_pos = kv_lo + tl.arange(0, BLOCK_N)
    in_range = k_pos < kv_hi
    fresh = in_range & (k_pos >= context_len)
    offsets = _kv_tile_offsets(
        block_table, kv_head_offset, k_pos, fresh, dims, stride_cache_block, stride_cache_slot, KV_BLOCK_SIZE
    )
    mask = fresh[:, None]
    if PAD_DIM:
        mask = mask & dim_ok[None, :]
    k = tl.where(fresh[:, None], tl.load(k_cache + offsets, mask=mask, other=0.0), first_k).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet (an empty split) subtracts 0: p and alpha are 0, nothing changes.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.where(fresh[:, None], tl.load(v_cache + offsets, mask=mask, other=0.0), first_v).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# num_seqs and the block table's row stride (the step's widest request, in blocks) change every step:
# left to Triton's default, each would specialise on == 1 and % 16 == 0 and compile new variants while
# serving (an 8B server measured 0.7-0.9 s stalls for num_seqs, a 0.6B one 1.4 s for the stride).
@triton.jit(do_not_specialize=["num_seqs", "stride_block_table"])
def _paged_attention_kernel(
    query,
    k_cache,
    v_cache,
    out,
    partial_out,
    partial_lse,
    block_tables,
    seq_lens,
    query_start_loc,
    num_seqs,
    qk_scale,
    v_scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr,
    PRECISION: tl.constexpr,
    SEQ_FILTER: tl.constexpr = 0,
    DOT_FP16: tl.constexpr = False,
    PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    """One program: BLOCK_Q query tokens x the GROUP heads of one KV head (BLOCK_M rows, token-major),
    against split program_id(2) of its request's keys. DECODE maps program_id(0) straight to a request.
    SEQ_FILTER 1 takes only the requests with one query token, 2 only the others (0: every request): a
    batch that mixes prompt chunks and decodes runs as two launches, each with its own tile size.
    EARLY (pdl.EARLY_READS): the step's metadata, and for a decode the first key tile of its split
    without this step's own key, are read before the PDL wait (no kernel of the step writes them); the
    step's key and value, which the launch before stores, are read after it into that tile."""
    if not EARLY:
        pdl.start(PDL)  # before the early exits below: every program waits
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tl.program_id(0)
        q_tile = 0
    else:
        # Last tiles first: a request's later query tiles see the most keys, so starting them early
        # shortens the tail of the launch.
        tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = _find_seq(query_start_loc, num_seqs, tile_id, BLOCK_Q)
        q_tile = tile_id - (tl.load(query_start_loc + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - query_len
    if EARLY and DECODE:
        first_k, first_v = _early_kv_tile(
            k_cache, v_cache, block_tables, seq, seq_len, context_len, kv_head, split, stride_block_table,
            stride_cache_block, stride_cache_slot, stride_cache_head, HEAD_DIM, HEAD_DIM_PAD, KV_BLOCK_SIZE,
            BLOCK_N, NUM_SPLITS,
        )  # fmt: skip
    if EARLY:
        pdl.start(PDL)  # before the exits: every program waits
    # Padded requests (query_len 0) and the gaps of the tile numbering stop here, before any load.
    if q_tile * BLOCK_Q >= query_len:
        return
    if SEQ_FILTER == 1:  # noqa: SIM102 (a constexpr test first: Triton compiles the branch away)
        if query_len != 1:
            return
    if SEQ_FILTER == 2:  # noqa: SIM102
        if query_len == 1:
            return

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_offsets = (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(query + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP16:
        # An FP8 cache under bf16 queries: keys, values and probabilities meet the query in fp16, since
        # Hopper turns two e4m3 values into fp16 in one instruction and into bf16 only through fp32.
        # fp16 keeps more mantissa than bf16; the query is clamped to its range.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    # Rows past the request's last token sit past seq_len, see every key and so stay finite.
    q_pos = context_len + tok

    first_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    kv_lo, kv_hi = _split_range(kv_end, split, NUM_SPLITS, BLOCK_N)
    # Keys before first_pos + 1 are visible to every row: whole tiles of them skip the causal mask,
    # and tiles past the tile's last query position are never visited.
    unmasked_hi = tl.maximum(kv_lo, tl.minimum(kv_hi, first_pos + 1) // BLOCK_N * BLOCK_N)

    block_table = block_tables + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if EARLY and DECODE:
        # The first tile, read before the wait but for this step's key and value; the loops go on after it.
        acc, m_i, l_i = _attend_early_tile(
            acc, m_i, l_i, q, first_k, first_v, k_cache, v_cache, block_table, kv_head_offset, kv_lo, kv_hi,
            context_len, qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok, KV_BLOCK_SIZE,
            BLOCK_N, HEAD_DIM != HEAD_DIM_PAD, PRECISION,
        )  # fmt: skip
        kv_lo = kv_lo + BLOCK_N
        unmasked_hi = tl.maximum(kv_lo, unmasked_hi)
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, kv_lo, unmasked_hi,
        qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
        KV_BLOCK_SIZE, BLOCK_N, False, HEAD_DIM != HEAD_DIM_PAD, PRECISION,
    )  # fmt: skip
    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, unmasked_hi, kv_hi,
        qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
        KV_BLOCK_SIZE, BLOCK_N, True, HEAD_DIM != HEAD_DIM_PAD, PRECISION,
    )  # fmt: skip

    # An empty split (short request, many splits) has l_i == 0: it reports lse -inf and a zero output.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    # v_scale: an FP8 cache holds V / v_scale; the weighted sum is linear in V, so one multiply here.
    result = acc * (v_scale / l_safe)[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        o_offsets = (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=store_mask)
    else:
        num_heads = GROUP * tl.num_programs(1)
        partial_row = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_out + partial_row[:, None] * HEAD_DIM + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(partial_lse + partial_row, lse, mask=row_ok)


# Programs per multiprocessor from which a decode launch over an FP8 cache takes small tiles of two warps.
_FP8_MANY_PROGRAMS = 4


def decode_config(
    group: int, element_size: int, cache_element_size: int | None = None, programs_per_sm: float = 0.0
) -> TileConfig:
    """One decode token's GROUP heads padded to 16 rows, the smallest tensor-core tile. An FP8 cache reads
    128 keys a tile, as many bytes as 64 bf16 keys (with 64, FP8 KV ran slower than bf16 at 32k, H200);
    but a launch of many short programs (many requests, no KV splits: programs_per_sm of at least
    _FP8_MANY_PROGRAMS) reads 64 keys a tile with two warps, the fastest at 256 x 544 and 128 x 1,024 on
    an H200 (docs/performance.md: 122 against 141 us and 100 against 107 us a layer)."""
    block_m = max(16, triton.next_power_of_2(group))
    fp8_cache = cache_element_size == 1 and element_size <= 2
    if fp8_cache and programs_per_sm >= _FP8_MANY_PROGRAMS:
        return TileConfig(block_m=block_m, block_n=64, num_warps=2, num_stages=3)
    block_n = 128 if fp8_cache else 64 if element_size <= 2 else 32
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=4, num_stages=3)


def prefill_config(max_query_len: int, group: int, head_dim: int, element_size: int) -> TileConfig:
    """Short query chunks (a decode in a mixed batch, a speculative verify) get a small tile; fp32
    (tests only) gets smaller tiles so its doubled operand size still fits in registers."""
    rows = max_query_len * group
    block_m = 16 if rows <= 16 else 64 if rows <= 64 or element_size > 2 else 128
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 64 if element_size <= 2 else 32
    num_warps = 8 if block_m == 128 and head_dim > 64 else 4
    return TileConfig(
        block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=3 if block_m < 128 else 2
    )


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
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged context; see the reference.

    max_query_len (1 selects the decode kernel) saves a device sync when given, and must be given under
    CUDA graph capture. max_seq_len and num_kv_splits only shape the split-KV decode: pass a fixed
    num_kv_splits when capturing a graph. num_decodes, the requests with one query token, lets a batch
    that mixes them with longer queries give them the decode kernel's small tile: in one launch each
    would fill a prompt-sized tile (128 rows for a GQA group of 2) and pay for all of it. Rows of `out`
    that no request owns are left untouched.
    """
    num_tokens, num_heads, head_dim = query.shape
    kv_block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if num_tokens == 0 or max_query_len == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    decode = max_query_len == 1
    if decode:
        block_q = 1
        if num_kv_splits is None:
            num_kv_splits = default_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
        grid = (num_seqs, num_kv_heads, num_kv_splits)
        # Split launches keep the long-context tiles (the small ones were measured without splits).
        programs_per_sm = num_seqs * num_kv_heads / sm_count(query.device) if num_kv_splits == 1 else 0.0
        config = decode_config(group, query.element_size(), k_cache.element_size(), programs_per_sm)
    else:
        config = prefill_config(max_query_len, group, head_dim, query.element_size())
        block_q = config.block_m // group
        num_kv_splits = 1
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, 1)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    # An FP8 cache is read into the query's dtype (exact: e4m3 fits in bf16, fp16 and fp32), into fp16
    # under bf16 queries; its per-tensor scales fold into the softmax scale (K) and the output (V).
    dot_fp16 = k_cache.element_size() == 1 and query.dtype == torch.bfloat16

    def launch(grid, partial_out, partial_lse, tile: TileConfig, block_q: int, num_splits: int, decode: bool,
               seq_filter: int) -> None:  # fmt: skip
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, partial_out, partial_lse,
            block_tables, seq_lens, query_start_loc, num_seqs, scale * k_scale * _LOG2_E, v_scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, KV_BLOCK_SIZE=kv_block_size,
            BLOCK_M=tile.block_m, BLOCK_Q=block_q, BLOCK_N=tile.block_n, NUM_SPLITS=num_splits,
            DECODE=decode, PRECISION=precision, SEQ_FILTER=seq_filter, DOT_FP16=dot_fp16,
            EARLY=pdl.EARLY_READS, num_warps=tile.num_warps, num_stages=tile.num_stages,
            **pdl.launch_args(query),
        )  # fmt: skip

    small = config if decode else decode_config(group, query.element_size(), k_cache.element_size())
    split_mixed = not decode and num_decodes > 0 and config.block_m > small.block_m
    if split_mixed:
        # The decodes first, one program per request and KV head, no KV splits (the prompt chunks'
        # launch below keeps the device busy); then the prompt chunks, whose launch skips them.
        launch((num_seqs, num_kv_heads, 1), out, out, small, 1, 1, True, seq_filter=1)
    if num_kv_splits > 1:
        partial_out = torch.empty(
            num_seqs * num_heads * num_kv_splits * head_dim, dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty(
            num_seqs * num_heads * num_kv_splits, dtype=torch.float32, device=query.device
        )
    else:
        partial_out = partial_lse = out
    launch(grid, partial_out, partial_lse, config, block_q, num_kv_splits, decode, 2 if split_mixed else 0)
    if num_kv_splits > 1:
        merge_splits(partial_out, partial_lse, out, query_start_loc, num_seqs, num_kv_splits)
    return out
