"""Decode attention over an e4m3 KV cache on the tensor cores (kernels/fp8_decode_attention.cu: CUDA C,
compiled at first use by NVRTC, kernels/cuda_rtc.py), for kernels/attention.py's decode launches
(`routed_decode`). Same inputs and results as the Triton decode kernel (and the reference's
paged_attention): one query token a request, the cache [blocks, block_size, kv_heads, head_dim] in
float8_e4m3fn with per-tensor k_scale and v_scale, 16-bit queries, head_dim 64 or 128, up to 16 query
heads a KV head, pages of a multiple of 16 slots, a device of compute capability 8.9 or later.

Why CUDA: each lane's loaded bytes of keys and values go into the MMA's fragments as they lie (the sum over
k may take its values in any order both operands share) and the scores' fragments are the probabilities'
without a shuffle, so the loop spends a few instructions a byte where the Triton kernel, whose layouts
pass the e4m3 tiles through shared memory a byte at a time, spends ~28 a key (docs/performance.md).

DECODE_CUDA decides whether attention.paged_attention routes FP8 decodes here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from tokenmill.kernels import StepRotary, cuda_rtc, pdl, sm_count
from tokenmill.kernels.rotary import rotary_and_write_kv_cache
from tokenmill.kernels.split_kv import (
    LOG2_E,
    default_num_kv_splits,
    merge_counts,
    merge_splits,
    split_partials,
)

logger = logging.getLogger("tokenmill")
SOURCE = Path(__file__).with_name("fp8_decode_attention.cu")
# On: as fast as the Triton decode or faster at every size timed (docs/performance.md, forty-fourth
# session); TOKENMILL_FP8_DECODE_CUDA=0 turns it off.
DECODE_CUDA = os.environ.get("TOKENMILL_FP8_DECODE_CUDA", "1") == "1"
# Whether a split launch merges its splits itself (the last split block of each request's KV head, the
# kernel's MERGE) instead of in split_kv's merge launch after it: one launch a layer fewer at long contexts.
# TOKENMILL_FP8_DECODE_MERGE=1 turns it on; off until timed on an H200 (fiftieth session).
MERGE_IN_KERNEL = os.environ.get("TOKENMILL_FP8_DECODE_MERGE", "0") == "1"


class DecodeConfig(NamedTuple):
    warps: int  # a block's warps, taking the split's 16-key tiles in turn
    ahead: int  # tiles a warp loads ahead of the one it computes (registers: ~207 at 1, ~243 at 2)
    # Blocks a multiprocessor the compiler must leave registers for (__launch_bounds__): more blocks hide
    # each one's first loads and final merge behind the others' tiles, at the price of spills if too many.
    min_blocks: int = 1


# Few requests (long contexts, split): two warps a block. Many requests (at least MANY_BLOCKS_PER_SM
# blocks a multiprocessor, one split): one warp a block, nine blocks a multiprocessor, so each block's
# first loads and final merge hide behind the others' tiles (an H100, us a layer against four warps: 110 /
# 124 at 256 x 544, 102 / 111 at 128 x 1,024). Two warps against four (H100): 193.6 / 200.7 us a layer at
# 64 x 4k, level at 16 x 32k; the batch-64 FP8-KV step 6.77 / 6.98 ms, alternated in one call
# (forty-ninth session, docs/performance.md).
FEW_REQUESTS = DecodeConfig(warps=2, ahead=1)
MANY_REQUESTS = DecodeConfig(warps=1, ahead=1)
MANY_BLOCKS_PER_SM = 4


def launch_config(num_seqs: int, num_kv_heads: int, device: torch.device) -> DecodeConfig:
    """The tiles of a launch over num_seqs requests (CONFIG where TOKENMILL_FP8_DECODE_TILES sets one)."""
    if CONFIG is not None:
        return CONFIG
    many = num_seqs * num_kv_heads >= MANY_BLOCKS_PER_SM * sm_count(device)
    return MANY_REQUESTS if many else FEW_REQUESTS


def parse_tiles(text: str, source: str = "TOKENMILL_FP8_DECODE_TILES") -> DecodeConfig:
    """DecodeConfig from "warps,ahead[,min_blocks]"; a ValueError naming `source` for anything else."""
    try:
        values = [int(v) for v in text.split(",")]
        if not 2 <= len(values) <= 3 or min(values) < 1:
            raise ValueError
    except ValueError:
        raise ValueError(f"{source}={text!r}: give warps,ahead[,min_blocks] (positive integers)") from None
    return DecodeConfig(*values)


def _config_from_env() -> DecodeConfig | None:
    forced = os.environ.get("TOKENMILL_FP8_DECODE_TILES")
    return parse_tiles(forced) if forced else None


# Every launch's tiles where TOKENMILL_FP8_DECODE_TILES="warps,ahead[,min_blocks]"
# sets them (the benchmarks); None: launch_config's rule.
CONFIG = _config_from_env()
HEAD_DIMS = (64, 128)  # (256 spills: its output fragments alone are 128 registers)
MAX_GROUP = 16  # the MMA's 16 rows
_MIN_KEYS_PER_SPLIT = 512  # 8 tiles a warp at least


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
             seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> bool:  # fmt: skip
    """Whether fp8_decode_attention can compute this decode (the shapes, dtypes and device above)."""
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return False
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        return False
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if head_dim not in HEAD_DIMS or cache_dim != head_dim or block_size % 16 or num_heads % num_kv_heads:
        return False
    if num_heads // num_kv_heads > MAX_GROUP or query.stride(2) != 1:
        return False
    # 16-byte loads (8 at head_dim 64) of every row: aligned strides and bases, contiguous dims.
    align = 16 if head_dim == 128 else 8
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        return False
    if any(s % align for s in k_cache.stride()[:3]) or k_cache.data_ptr() % 16 or v_cache.data_ptr() % 16:
        return False
    if any(t.dtype != torch.int32 for t in (block_tables, seq_lens, query_start_loc)):
        return False
    if block_tables.stride(1) != 1 or max(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)) >= 2**31:
        return False
    return cuda_rtc.runs_on(query.device, (8, 9))


def fuses_rotary(query: torch.Tensor, rotary: StepRotary) -> bool:
    """Whether the launch can take `rotary` itself: int64 positions and slots, key and value in the
    query's dtype and the cos/sin cache in it or in float32 (as layers/rotary.py holds it), with contiguous
    rows, the cos/sin rows spanning head_dim."""
    positions, cos_sin_cache, key, value, slot_mapping = rotary
    if positions.dtype != torch.int64 or slot_mapping.dtype != torch.int64:
        return False
    if cos_sin_cache.dtype not in (query.dtype, torch.float32):
        return False
    if any(t.dtype != query.dtype for t in (key, value)):
        return False
    if any(t.stride(-1) != 1 for t in (cos_sin_cache, key, value)):
        return False
    return (
        cos_sin_cache.shape[-1] == query.shape[-1]
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
    )


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int | None, device: torch.device
) -> int:
    """KV splits: split_kv's rule with four blocks a multiprocessor (two fit by registers; the others
    queue behind them and fill the tail) and never a split under _MIN_KEYS_PER_SPLIT keys.
    TOKENMILL_FP8_DECODE_SPLITS sets one (the benchmarks)."""
    forced = os.environ.get("TOKENMILL_FP8_DECODE_SPLITS")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"TOKENMILL_FP8_DECODE_SPLITS={forced!r}: give a positive number of splits")
        return int(forced)
    return default_num_kv_splits(num_seqs, num_kv_heads, max_seq_len, device, 4, _MIN_KEYS_PER_SPLIT)


def routed_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *args, **kwargs,
) -> torch.Tensor | None:  # fmt: skip
    """An FP8 decode (fp8_decode_attention's arguments) computed here where DECODE_CUDA is on and the
    kernel `supports` it; None, with nothing written, where not, and where NVRTC cannot build the kernel
    for this GPU (then the route turns itself off with a warning): the caller decodes with Triton."""
    global DECODE_CUDA
    inputs = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if not (DECODE_CUDA and supports(*inputs)):
        return None
    try:
        return fp8_decode_attention(*inputs, *args, **kwargs)
    except cuda_rtc.CudaRtcError as error:
        DECODE_CUDA = False
        logger.warning("the CUDA FP8 decode does not build here, decoding with Triton: %s", error)
        return None


def fp8_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    rotary: StepRotary | None = None,
) -> torch.Tensor:
    """out[q_start of each request] = attention of its one query token [T, H, D] over its seq_lens keys
    in the paged e4m3 cache (which holds K / k_scale and V / v_scale); rows no request owns are left
    untouched. With `rotary` (as paged_attention's) the query and the step's key arrive unrotated: the
    launch rotates them and stores the step's key and value itself where the rotary inputs' dtypes allow
    (`fuses_rotary`), else a rotary launch does first (the query rotated in place); without it the step's
    key must be in the cache already."""
    if not supports(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc):
        raise ValueError("fp8_decode_attention does not take these shapes (see supports)")
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(query)
    elif out.stride(2) != 1 or out.dtype != query.dtype:
        raise ValueError("fp8_decode_attention: out must have the query's dtype and a contiguous head_dim")
    if num_seqs == 0:
        return out
    fused = rotary is not None and fuses_rotary(query, rotary)
    splits = num_kv_splits or default_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    merge = splits > 1 and MERGE_IN_KERNEL
    config = launch_config(num_seqs, num_kv_heads, query.device)
    defines = dict(
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=k_cache.shape[1], BF16=int(query.dtype == torch.bfloat16),
        WARPS=config.warps, AHEAD=config.ahead, MIN_BLOCKS=config.min_blocks, SPLIT=int(splits > 1),
        ROTARY=int(fused), COS_SIN_F32=int(fused and rotary.cos_sin_cache.dtype == torch.float32),
        EARLY=int(pdl.EARLY_READS), MERGE=int(merge),
    )  # fmt: skip
    # Built (or a CudaRtcError raised) before anything is written: a caller may then decode elsewhere.
    kernel = cuda_rtc.kernel(SOURCE, "fp8_decode_attention", query.device, defines)
    if rotary is not None and not fused:
        query, _ = rotary_and_write_kv_cache(
            rotary.positions, query, rotary.key, rotary.value, rotary.cos_sin_cache, k_cache, v_cache,
            rotary.slot_mapping, k_scale, v_scale,
        )  # fmt: skip
    if fused:
        positions, cos_sin_cache, key, value, slot_mapping = rotary
    else:  # unused pointers
        positions = cos_sin_cache = key = value = slot_mapping = query
    if splits > 1:
        partial_out, partial_lse = split_partials(num_seqs, num_heads, splits, head_dim, query.device)
    else:
        partial_out = partial_lse = out  # unused
    counts = merge_counts(query.device, num_seqs * num_kv_heads) if merge else seq_lens  # (unused: seq_lens)
    kernel(
        grid=(num_seqs, num_kv_heads, splits),
        block=(config.warps * 32,),
        shared=config.warps * group * (head_dim + 2) * 4,
        args=[
            query, k_cache, v_cache, out, partial_out, partial_lse, block_tables, seq_lens, query_start_loc,
            scale * k_scale * LOG2_E, k_scale, v_scale, query.stride(0), query.stride(1),
            out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), positions, cos_sin_cache, key, value, slot_mapping,
            cos_sin_cache.stride(0), key.stride(0), key.stride(1), value.stride(0), value.stride(1), counts,
        ],
        pdl=pdl.enabled(query),
    )  # fmt: skip
    if splits > 1 and not merge:
        merge_splits(partial_out, partial_lse, out, query_start_loc, num_seqs, splits)
    return out
