"""Triton paged attention over the paged KV cache: prefill, chunked prefill and decode in one kernel,
with query heads of a KV group packed into one tensor-core tile and split-KV for long decodes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tokenmill.kernels import StepRotary, env_int, fp8_decode_cuda, pdl, sm_count
from tokenmill.kernels.attention_tiles import (  # noqa: F401 (the tile configs: attention's own names)
    _FP8_MANY_PROGRAMS,
    TileConfig,
    as_pair_words,
    attend_kv_range,
    attend_tile,
    cached_tile,
    decode_config,
    find_seq,
    fp8_pair_words,
    last_tile_start,
    prefill_config,
    rotate_half,
    split_range,
    store_step_kv,
    widen_pairs,
)
from tokenmill.kernels.rotary import rotary_and_write_kv_cache
from tokenmill.kernels.split_kv import (
    LOG2_E,
    default_num_kv_splits,
    merge_counts,
    merge_splits,
    split_partials,
    store_split_result,
)

# A decode over an e4m3 cache under bf16 queries reads its tiles (the newest keys' register tile, the
# whole tiles, the remainder) as 16-bit words of two values widened in registers (attention_tiles
# .widen_pairs; sm_90 SASS: a quarter of the shared-memory loads; registers 255 -> 177 at 64 keys and two
# warps, where the value reads spill, and 253 -> 162 at 128 keys and four). Off until timed on a GPU
# (TOKENMILL_FP8_PAIR_LOADS=1 turns it on). Triton's interpreter takes the same path without the PTX.
FP8_PAIR_LOADS = os.environ.get("TOKENMILL_FP8_PAIR_LOADS") == "1"
# A register cap for those decodes (None: the compiler's choice), so that more blocks share a
# multiprocessor: at 168, 6 blocks of the 64-key two-warp tile instead of 5. For A/B until timed.
FP8_PAIR_MAXNREG = env_int("TOKENMILL_FP8_PAIR_MAXNREG", 0) or None
# Whether a split decode merges its own splits (split_kv.merge_if_last) instead of merge_splits' launch
# after it: a launch a layer fewer (~1.1 us of the batch-1 FP8 step on an H200, twenty-seventh session).
# TOKENMILL_DECODE_MERGE=1 turns it on; off until timed (the CUDA FP8 decode's: fp8_decode_cuda's).
MERGE_IN_KERNEL = os.environ.get("TOKENMILL_DECODE_MERGE", "0") == "1"


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
    k_scale,
    v_scale,
    positions,
    cos_sin_cache,
    key,
    value,
    slot_mapping,
    stride_cos,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    merge_counts,
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
    ROTARY: tl.constexpr = False,
    HALF_DIM: tl.constexpr = 1,
    LAST_N: tl.constexpr = 64,
    FP8_PAIRS: tl.constexpr = False,
    MERGE: tl.constexpr = False,
    SPLITS_PAD: tl.constexpr = 1,
):
    """One program: BLOCK_Q query tokens x the GROUP heads of one KV head (BLOCK_M rows, token-major),
    against split program_id(2) of its request's keys. DECODE maps program_id(0) straight to a request.
    SEQ_FILTER 1 takes only the requests with one query token, 2 only the others (0: every request): a
    batch that mixes prompt chunks and decodes runs as two launches, each with its own tile size.
    A decode takes the last LAST_N keys of its split into registers first (the newest keys: the step's own
    key, in the split that holds it; fewer than BLOCK_N where a tile of BLOCK_N would not fit in
    registers), then the tiles before them. EARLY (pdl.EARLY_READS): the step's
    metadata and that tile as earlier steps left it are read before the PDL wait (no kernel of the
    step writes them); the step's key and value, which the launch before stores, after it. ROTARY
    (decodes only): query and key arrive unrotated (positions, cos_sin_cache): the program rotates its
    query rows, and the one whose split holds the step's key rotates it, stores it and the value at the
    step's slot (FP8: as x / scale) and attends to them from registers; one launch instead of two. MERGE
    (a decode over NUM_SPLITS > 1): the splits merged by the last one to finish (merge_if_last)."""
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
        seq = find_seq(query_start_loc, num_seqs, tile_id, BLOCK_Q)
        q_tile = tile_id - (tl.load(query_start_loc + seq) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - q_start
    seq_len = tl.load(seq_lens + seq)
    context_len = seq_len - query_len
    if DECODE:
        block_table = block_tables + seq.to(tl.int64) * stride_block_table
        kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        offs_n = tl.arange(0, LAST_N)
        # The split's last tile as earlier steps left it: keys before context_len (the step's own key, at
        # context_len, is put in after the wait where this split holds it).
        kv_lo, kv_hi = split_range(seq_len, split, NUM_SPLITS, BLOCK_N)
        tile_lo = last_tile_start(kv_lo, kv_hi, LAST_N)
        tile_ok = tile_lo + offs_n < kv_hi
        fresh = tile_ok & (tile_lo + offs_n >= context_len)
        last_k, last_v = cached_tile(
            k_cache, v_cache, block_table, kv_head_offset, tile_lo + offs_n, tile_ok & ~fresh, dims, dim_ok,
            stride_cache_block, stride_cache_slot, KV_BLOCK_SIZE, WORDS=FP8_PAIRS,
        )  # fmt: skip
        owner = (kv_lo <= context_len) & (context_len < kv_hi)
        if not ROTARY:  # the row where the launch before stores the step's key and value
            page = tl.load(block_table + context_len // KV_BLOCK_SIZE, mask=owner, other=0).to(tl.int64)
            step_row = page * stride_cache_block + (context_len % KV_BLOCK_SIZE) * stride_cache_slot
        else:
            has_token = query_len > 0
            pos = tl.load(positions + q_start, mask=has_token, other=0).to(tl.int64)
            half = dims % HALF_DIM
            cos = tl.load(cos_sin_cache + pos * stride_cos + half, mask=dim_ok, other=0.0).to(tl.float32)
            sin = tl.load(cos_sin_cache + pos * stride_cos + HALF_DIM + half, mask=dim_ok, other=0.0)
            sin = sin.to(tl.float32)
            slot = tl.load(slot_mapping + q_start, mask=has_token, other=-1).to(tl.int64)
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

    if not DECODE:
        block_table = block_tables + seq.to(tl.int64) * stride_block_table
        kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < query_len)
    q_rows = query + (q_start + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head
    q_mask = row_ok[:, None] & dim_ok[None, :]
    if ROTARY:
        # Rounded to the query's dtype, as the rotary launch stores it.
        q = rotate_half(q_rows, dims, q_mask, cos, sin, HALF_DIM).to(query.dtype.element_ty)
    else:
        q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)
    if DOT_FP16:
        # An FP8 cache under bf16 queries: keys, values and probabilities meet the query in fp16, since
        # Hopper turns two e4m3 values into fp16 in one instruction and into bf16 only through fp32.
        # fp16 keeps more mantissa than bf16; the query is clamped to its range.
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    # Rows past the request's last token sit past seq_len, see every key and so stay finite.
    q_pos = context_len + tok

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if DECODE:
        # The last tile with the step's key and value put in (at context_len, where this split holds it),
        # as the cache holds them (FP8_PAIRS: as words of two values, widened once the tile is whole).
        if ROTARY:
            new_k, new_v = store_step_kv(
                key + q_start * stride_key_tok + kv_head * stride_key_head,
                value + q_start * stride_value_tok + kv_head * stride_value_head,
                k_cache, v_cache, slot, kv_head_offset, owner, dims, dim_ok, cos, sin, k_scale, v_scale,
                stride_cache_block, stride_cache_slot, KV_BLOCK_SIZE, HALF_DIM,
            )  # fmt: skip
            if FP8_PAIRS:
                new_k, new_v = as_pair_words(new_k), as_pair_words(new_v)
            k_tile = tl.where(fresh[:, None], new_k[None, :], last_k)
            v_tile = tl.where(fresh[:, None], new_v[None, :], last_v)
        elif FP8_PAIRS:
            # Read into the registers that hold the tile (a predicated load, no select): every row points
            # at the step's, only its own reads.
            step_rows = step_row + kv_head_offset + tl.zeros([LAST_N], tl.int64)
            k_tile = fp8_pair_words(k_cache, step_rows, fresh, HEAD_DIM // 2, True, last_k)
            v_tile = fp8_pair_words(v_cache, step_rows, fresh, HEAD_DIM // 2, True, last_v)
        else:
            rows = step_row + kv_head_offset + tl.zeros([LAST_N, 1], tl.int64) + dims[None, :]
            fresh_mask = fresh[:, None] & dim_ok[None, :]
            k_tile = tl.load(k_cache + rows, mask=fresh_mask, other=last_k)
            v_tile = tl.load(v_cache + rows, mask=fresh_mask, other=last_v)
        if FP8_PAIRS:
            k_tile, v_tile = widen_pairs(k_tile), widen_pairs(v_tile)
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_tile, v_tile, tile_ok, qk_scale, PRECISION)
        # The keys before it, every one visible to the decode's row: whole tiles, then what is left of a
        # tile (when LAST_N < BLOCK_N).
        whole_hi = kv_lo + (tile_lo - kv_lo) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = attend_kv_range(
            acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, kv_lo, whole_hi,
            qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
            KV_BLOCK_SIZE, BLOCK_N, False, HEAD_DIM != HEAD_DIM_PAD, PRECISION, FP8_PAIRS,
        )  # fmt: skip
        if LAST_N < BLOCK_N:
            acc, m_i, l_i = attend_kv_range(
                acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, whole_hi, tile_lo,
                qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
                KV_BLOCK_SIZE, BLOCK_N, True, HEAD_DIM != HEAD_DIM_PAD, PRECISION, FP8_PAIRS,
            )  # fmt: skip
    else:
        first_pos = context_len + q_tile * BLOCK_Q
        kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
        kv_lo, kv_hi = split_range(kv_end, split, NUM_SPLITS, BLOCK_N)
        # Keys before first_pos + 1 are visible to every row: whole tiles of them skip the causal mask,
        # and tiles past the tile's last query position are never visited.
        unmasked_hi = tl.maximum(kv_lo, tl.minimum(kv_hi, first_pos + 1) // BLOCK_N * BLOCK_N)
        acc, m_i, l_i = attend_kv_range(
            acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, kv_lo, unmasked_hi,
            qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
            KV_BLOCK_SIZE, BLOCK_N, False, HEAD_DIM != HEAD_DIM_PAD, PRECISION,
        )  # fmt: skip
        acc, m_i, l_i = attend_kv_range(
            acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, unmasked_hi, kv_hi,
            qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
            KV_BLOCK_SIZE, BLOCK_N, True, HEAD_DIM != HEAD_DIM_PAD, PRECISION,
        )  # fmt: skip

    # An empty split (short request, many splits) has l_i == 0: it reports lse -inf and a zero output.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    # v_scale: an FP8 cache holds V / v_scale; the weighted sum is linear in V, so one multiply here.
    result = acc * (v_scale / l_safe)[:, None]
    store_split_result(
        out, partial_out, partial_lse, merge_counts, result, m_i, l_i, l_safe, row_ok, dims, dim_ok, seq,
        kv_head, split, q_start, tok, head, tl.num_programs(1), stride_o_tok, stride_o_head,
        GROUP, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD, MERGE,
    )  # fmt: skip


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
    """Causal attention of packed queries over each request's paged context; see the reference.

    max_query_len (1 selects the decode kernel) saves a device sync when given, and must be given under
    CUDA graph capture. max_seq_len and num_kv_splits only shape the split-KV decode: pass a fixed
    num_kv_splits when capturing a graph. num_decodes, the requests with one query token, lets a batch
    that mixes them with longer queries give them the decode kernel's small tile: in one launch each
    would fill a prompt-sized tile (128 rows for a GQA group of 2) and pay for all of it. Rows of `out`
    that no request owns are left untouched. With `rotary` (see the reference) a decode rotates the
    query and the step's key and stores the step's key and value itself (one launch, not two); other
    steps run kernels/rotary.py's launch first.
    """
    # Decodes over an FP8 cache go to the CUDA kernel, rotary and all, where it takes them and builds.
    if max_query_len == 1:
        done = fp8_decode_cuda.routed_decode(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
            max_seq_len=max_seq_len, num_kv_splits=num_kv_splits, k_scale=k_scale, v_scale=v_scale,
            rotary=rotary,
        )  # fmt: skip
        if done is not None:
            return done
    if rotary is not None and max_query_len != 1:
        query, _ = rotary_and_write_kv_cache(
            rotary.positions, query, rotary.key, rotary.value, rotary.cos_sin_cache, k_cache, v_cache,
            rotary.slot_mapping, k_scale, v_scale,
        )  # fmt: skip
        rotary = None
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
    # Pair loads: a pair's word 2-byte aligned, no padded dims (a word would straddle the last one).
    even = all(stride % 2 == 0 for stride in k_cache.stride()[:3])
    fp8_pairs = (
        FP8_PAIR_LOADS
        and dot_fp16
        and k_cache.dtype == torch.float8_e4m3fn
        and even
        and head_dim == head_dim_pad
    )
    capped = {"maxnreg": FP8_PAIR_MAXNREG} if decode and fp8_pairs and FP8_PAIR_MAXNREG else {}

    if rotary is not None:
        positions, cos_sin_cache, key, value, slot_mapping = rotary
        if cos_sin_cache.shape[-1] != head_dim or key.stride(-1) != 1 or value.stride(-1) != 1:
            raise ValueError("rotary: the cos/sin cache must span head_dim, key and value rows be contiguous")
    else:  # unused pointers
        positions = cos_sin_cache = key = value = slot_mapping = query

    # The merge in the decode's launch (MERGE_IN_KERNEL) or in merge_splits' after it.
    merge = decode and num_kv_splits > 1 and MERGE_IN_KERNEL
    counts = merge_counts(query.device, num_seqs * num_kv_heads) if merge else seq_lens  # (unused: seq_lens)

    def launch(grid, partial_out, partial_lse, tile: TileConfig, block_q: int, num_splits: int, decode: bool,
               seq_filter: int, merge: bool = False) -> None:  # fmt: skip
        _paged_attention_kernel[grid](
            query, k_cache, v_cache, out, partial_out, partial_lse,
            block_tables, seq_lens, query_start_loc, num_seqs, scale * k_scale * LOG2_E, k_scale, v_scale,
            positions, cos_sin_cache, key, value, slot_mapping, cos_sin_cache.stride(0),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), counts,
            GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, KV_BLOCK_SIZE=kv_block_size,
            BLOCK_M=tile.block_m, BLOCK_Q=block_q, BLOCK_N=tile.block_n, NUM_SPLITS=num_splits,
            DECODE=decode, PRECISION=precision, SEQ_FILTER=seq_filter, DOT_FP16=dot_fp16,
            EARLY=pdl.EARLY_READS, ROTARY=rotary is not None, HALF_DIM=head_dim // 2,
            # A decode's register tile: 16 keys a warp at most (64 FP8 keys of 128 widened to fp16 ran
            # the registers out).
            LAST_N=min(tile.block_n, 16 * tile.num_warps), FP8_PAIRS=fp8_pairs, MERGE=merge,
            SPLITS_PAD=triton.next_power_of_2(num_splits), num_warps=tile.num_warps,
            num_stages=tile.num_stages, **pdl.launch_args(query), **capped,
        )  # fmt: skip

    small = config if decode else decode_config(group, query.element_size(), k_cache.element_size())
    split_mixed = not decode and num_decodes > 0 and config.block_m > small.block_m
    if split_mixed:
        # The decodes first, one program per request and KV head, no KV splits (the prompt chunks'
        # launch below keeps the device busy); then the prompt chunks, whose launch skips them.
        launch((num_seqs, num_kv_heads, 1), out, out, small, 1, 1, True, seq_filter=1)
    if num_kv_splits > 1:
        partial_out, partial_lse = split_partials(num_seqs, num_heads, num_kv_splits, head_dim, query.device)
    else:
        partial_out = partial_lse = out
    launch(
        grid, partial_out, partial_lse, config, block_q, num_kv_splits, decode, 2 if split_mixed else 0, merge
    )
    if num_kv_splits > 1 and not merge:
        merge_splits(partial_out, partial_lse, out, query_start_loc, num_seqs, num_kv_splits)
    return out
