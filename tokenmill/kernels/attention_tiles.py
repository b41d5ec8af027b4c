"""The paged attention kernel's building blocks (kernels/attention.py): the request of a query tile, a
split's key range, a tile's offsets through the block table, the online-softmax update over a range of
tiles and over one tile a decode holds in registers, and a decode's own key and value: rotate-half
rotary of rows it reads itself, and their store into the cache; an FP8 tile read as pairs of values
widened to fp16 in registers before the tensor cores' layout takes them; and the tiles a launch takes
(TileConfig: decode_config, prefill_config)."""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tokenmill.kernels.interpreter import INTERPRETED

# widen_pairs' inline PTX, which Triton's interpreter does not run (it takes the byte-by-byte path).
_PTX = tl.constexpr(not INTERPRETED)


class TileConfig(NamedTuple):
    """Tile shape and launch options of one attention kernel launch."""

    block_m: int  # rows of the query tile: query tokens x heads of one KV group
    block_n: int  # keys per step of the KV loop
    num_warps: int
    num_stages: int


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


@triton.jit
def fp8_pair_words(cache, slot_offset, key_ok, HALF_PAD: tl.constexpr, MASKED: tl.constexpr, other=0):
    """An e4m3 cache's rows at slot_offset (dims from 0) as 16-bit words, each two adjacent dims:
    [N, HALF_PAD] int16 (MASKED: `other` where not key_ok)."""
    pairs = cache.to(tl.pointer_type(tl.int16), bitcast=True)
    offsets = slot_offset[:, None] // 2 + tl.arange(0, HALF_PAD)[None, :]
    if MASKED:
        return tl.load(pairs + offsets, mask=key_ok[:, None], other=other)
    return tl.load(pairs + offsets)


@triton.jit
def as_pair_words(values):
    """An e4m3 row [D] as fp8_pair_words reads it from memory: [D / 2] int16, dim 2i in the low byte."""
    byte = values.to(tl.uint8, bitcast=True).to(tl.int16)
    low, high = tl.split(tl.reshape(byte, (values.shape[0] // 2, 2)))
    return low | (high << 8)


@triton.jit
def widen_pairs(words):
    """fp8_pair_words' words [N, H] as fp16 values [N, 2 H]: each word widened in the layout it was read
    in (one cvt.rn.f16x2.e4m3x2 a word; in Triton's interpreter, byte by byte),
    then interleaved back into rows. Read through .to() instead, Triton moves the widening past its
    change to the tensor cores' operand layout, which then gathers bytes from shared memory one at a
    time (sm_90 SASS of the 64-key, two-warp decode loop: 172 -> 36 shared-memory loads, 832 -> 777
    instructions; of the 128-key, four-warp one: 180 -> 44 and 1,033 -> 759). Exact, as .to() is."""
    if _PTX:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }", "=h,=h,h", [words],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        lo = (words & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = ((words >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(lo, hi), (words.shape[0], 2 * words.shape[1]))


@triton.jit
def attend_kv_range(
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
    PAIRS: tl.constexpr = False,
):
    """Online-softmax update of (acc, m_i, l_i) with keys kv_lo..kv_hi read through the block table.
    Without CAUSAL_MASK every key of the range is visible to every row and in bounds. PAIRS (an e4m3
    cache, fp16 queries, no padded dims): the tiles are read as pair words (fp8_pair_words,
    widen_pairs)."""
    HALF_PAD: tl.constexpr = dims.shape[0] // 2
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
        if PAIRS:
            k = widen_pairs(fp8_pair_words(k_cache, slot_offset, k_pos < kv_hi, HALF_PAD, CAUSAL_MASK))
        else:
            k = tl.load(k_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if CAUSAL_MASK:
            visible = (k_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PAIRS:
            v = widen_pairs(fp8_pair_words(v_cache, slot_offset, k_pos < kv_hi, HALF_PAD, CAUSAL_MASK))
        else:
            v = tl.load(v_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def split_range(kv_end, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
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
def last_tile_start(kv_lo, kv_hi, BLOCK_N: tl.constexpr):
    """The first key of the last tile of [kv_lo, kv_hi) (kv_lo for an empty range): a decode's newest
    keys, its own among them in the split that holds it."""
    return kv_lo + tl.maximum(kv_hi - kv_lo - 1, 0) // BLOCK_N * BLOCK_N


@triton.jit
def cached_tile(k_cache, v_cache, block_table, kv_head_offset, k_pos, key_ok, dims, dim_ok,
                stride_cache_block, stride_cache_slot, KV_BLOCK_SIZE: tl.constexpr,
                WORDS: tl.constexpr = False):  # fmt: skip
    """Keys and values k_pos as the cache holds them (in its dtype; WORDS, an e4m3 cache: as
    fp8_pair_words), zeros where not key_ok."""
    page = tl.load(block_table + k_pos // KV_BLOCK_SIZE, mask=key_ok, other=0)
    slot = (
        page.to(tl.int64) * stride_cache_block + (k_pos % KV_BLOCK_SIZE) * stride_cache_slot + kv_head_offset
    )
    if WORDS:  # one return: Triton wants every return of a function to have the same types
        half: tl.constexpr = dims.shape[0] // 2
        keys = fp8_pair_words(k_cache, slot, key_ok, half, True)
        values = fp8_pair_words(v_cache, slot, key_ok, half, True)
    else:
        offsets = slot[:, None] + dims[None, :]
        mask = key_ok[:, None] & dim_ok[None, :]
        keys = tl.load(k_cache + offsets, mask=mask, other=0.0)
        values = tl.load(v_cache + offsets, mask=mask, other=0.0)
    return keys, values


@triton.jit
def rotate_half(rows, dims, mask, cos, sin, HALF_DIM: tl.constexpr):
    """Neox-style rotary embedding in fp32 of rows (pointers to their dimension 0: [R, 1], or one
    pointer for [1, D]) where mask ([R, D]) is set, 0 elsewhere: x1 cos - x2 sin in the first half, x2 cos
    + x1 sin in the second (cos, sin: [D], each half's value at both its dims). Read as two loads of the
    same rows, the second half-swapped, so the result keeps the rows' layout. The caller rounds where
    kernels/rotary.py rounds."""
    first = dims < HALF_DIM
    partner = tl.where(first, dims + HALF_DIM, dims - HALF_DIM)
    x = tl.load(rows + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x * cos[None, :] + swapped * tl.where(first, -sin, sin)[None, :]


@triton.jit
def attend_tile(acc, m_i, l_i, q, k, v, key_ok, qk_scale, PRECISION: tl.constexpr):
    """The online-softmax update with one tile of keys and values held in registers (a decode row sees
    every key_ok one). A row that has seen no key yet (an empty split) subtracts 0: p and alpha are 0 and
    (acc, m_i, l_i) stay as they were."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def find_seq(query_start_loc, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
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
def store_step_kv(key_row, value_row, k_cache, v_cache, slot, kv_head_offset, owner, dims, dim_ok, cos, sin,
                   k_scale, v_scale, stride_cache_block, stride_cache_slot, KV_BLOCK_SIZE: tl.constexpr,
                   HALF_DIM: tl.constexpr):  # fmt: skip
    """The step's key of one KV head rotated and its value, in the cache's dtype as kernels/rotary.py
    stores them (rounded to the key's dtype, then FP8 as x / scale saturated to e4m3); stored at `slot`
    by the program that owns the key (slot -1: padding, none). Returns (key, value), [HEAD_DIM_PAD]."""
    new_k = tl.reshape(rotate_half(key_row, dims, dim_ok[None, :], cos, sin, HALF_DIM), dims.shape)
    new_k = new_k.to(key_row.dtype.element_ty)
    new_v = tl.load(value_row + dims, mask=dim_ok, other=0.0)
    if k_cache.dtype.element_ty == tl.float8e4nv:
        new_k = tl.clamp(new_k.to(tl.float32) / k_scale, -448.0, 448.0)
        new_v = tl.clamp(new_v.to(tl.float32) / v_scale, -448.0, 448.0)
    new_k = new_k.to(k_cache.dtype.element_ty)
    new_v = new_v.to(v_cache.dtype.element_ty)
    offsets = (slot // KV_BLOCK_SIZE) * stride_cache_block + (slot % KV_BLOCK_SIZE) * stride_cache_slot
    mask = dim_ok & owner & (slot >= 0)
    tl.store(k_cache + offsets + kv_head_offset + dims, new_k, mask=mask)
    tl.store(v_cache + offsets + kv_head_offset + dims, new_v, mask=mask)
    return new_k, new_v
