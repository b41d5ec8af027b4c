"""Split-KV decode: how many splits of its keys a decode's programs take, and the launch that merges
the splits' partial outputs by their log-sum-exps (kernels/attention.py writes them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import pdl, sm_count

# A split shorter than this spends more on the reduce than it gains in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_KV_SPLITS = 32
# The decodes' softmax runs in exp2, so log2(e) folds into the score scale and the log-sum-exps the splits
# report (and the merge weighs) are base 2.
LOG2_E = 1.4426950408889634
# Counters of finished splits, one a (request, KV head), for the decodes that merge their splits in their
# own launch (the last split program to finish merges; it zeroes its counter again): one buffer a device,
# never freed (CUDA graphs hold its address), replaced by a larger one only where a launch needs more, the
# old ones kept. Shared by every such launch on the device, the CUDA FP8 decode's and the Triton one's:
# the engine's forwards run on one stream, so two launches never count at once (a PDL launch counts
# after its wait).
_MERGE_COUNTS: dict[torch.device, list[torch.Tensor]] = {}
_MIN_MERGE_COUNTS = 1 << 16


@triton.jit
def _reduce_splits_kernel(
    partial_out,
    partial_lse,
    out,
    query_start_loc,
    stride_o_tok,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    """Merge the splits of one (request, head) of a decode by their log-sum-exp weights. EARLY
    (pdl.EARLY_READS): the query offsets are read before the PDL wait (no kernel of the step writes them)."""
    if not EARLY:
        pdl.start(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc + seq)
    q_end = tl.load(query_start_loc + seq + 1)
    if EARLY:
        pdl.start(PDL)  # before the exit: every program waits
    if q_end == q_start:
        return
    merge_head(
        partial_out, partial_lse, out, seq, head, tl.num_programs(1), q_start, stride_o_tok, stride_o_head,
        NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD, "",
    )  # fmt: skip


@triton.jit
def merge_head(partial_out, partial_lse, out, seq, head, num_heads, q_start, stride_o_tok, stride_o_head,
               NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
               HEAD_DIM_PAD: tl.constexpr, CACHE: tl.constexpr):  # fmt: skip
    """out[q_start, head] from the head's NUM_SPLITS partials, weighted by their log-sum-exps. CACHE: the
    loads' cache modifier, "" or ".cg" (from L2 only: a decode's merging program reads what other programs
    wrote this launch, which its multiprocessor's L1 may hold stale from an earlier one)."""
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    rows = (seq.to(tl.int64) * num_heads + head) * NUM_SPLITS + splits
    lse = tl.load(partial_lse + rows, mask=splits < NUM_SPLITS, other=float("-inf"), cache_modifier=CACHE)
    # An empty split wrote lse -inf and a zero output, so it weighs nothing here.
    weight = tl.exp2(lse - tl.max(lse, 0))
    part_mask = (splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :]
    part = tl.load(
        partial_out + rows[:, None] * HEAD_DIM + dims[None, :],
        mask=part_mask,
        other=0.0,
        cache_modifier=CACHE,
    )
    result = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    o_offsets = q_start * stride_o_tok + head * stride_o_head + dims
    tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def store_split_result(out, partial_out, partial_lse, merge_counts, result, m_i, l_i, l_safe, row_ok, dims,
                       dim_ok, seq, kv_head, split, q_start, tok, head, num_kv_heads, stride_o_tok,
                       stride_o_head, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MERGE: tl.constexpr):  # fmt: skip
    """A paged-attention program's normalized rows `result` (its tokens tok, heads head): into `out`
    with one split; else its split's partial outputs and base-2 log-sum-exps (m_i + log2 l_i; an empty
    split, l_i 0, reports -inf) for merge_splits, or with MERGE merged by the last split (merge_if_last)."""
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        o_offsets = (q_start + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=store_mask)
    else:
        partial_row = (seq.to(tl.int64) * GROUP * num_kv_heads + head) * NUM_SPLITS + split
        tl.store(partial_out + partial_row[:, None] * HEAD_DIM + dims[None, :], result, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(partial_lse + partial_row, lse, mask=row_ok)
        if MERGE:
            merge_if_last(
                partial_out, partial_lse, out, merge_counts, seq, kv_head, num_kv_heads, q_start,
                stride_o_tok, stride_o_head, GROUP, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD,
            )  # fmt: skip


@triton.jit
def merge_if_last(partial_out, partial_lse, out, merge_counts, seq, kv_head, num_kv_heads, q_start,
                  stride_o_tok, stride_o_head, GROUP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):  # fmt: skip
    """In a split decode's program, after it stored its partials: count the split done; the last of the
    request's KV head's splits to finish merges the GROUP heads' partials into `out` (merge_head, its
    loads from L2) and zeroes the counter for the next launch. The barrier puts every thread's partials
    before the count; the atomic's release orders them for the program that counts last, whose acquire
    sees them all."""
    tl.debug_barrier()
    counter = merge_counts + seq * num_kv_heads + kv_head
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        for g in tl.static_range(GROUP):
            merge_head(
                partial_out, partial_lse, out, seq, kv_head * GROUP + g, num_kv_heads * GROUP, q_start,
                stride_o_tok, stride_o_head, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD, ".cg",
            )  # fmt: skip


def merge_counts(device: torch.device, size: int) -> torch.Tensor:
    """The device's zeroed split counters, at least `size` of them."""
    buffers = _MERGE_COUNTS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < size:
        buffers.append(torch.zeros(max(size, _MIN_MERGE_COUNTS), dtype=torch.int32, device=device))
    return buffers[-1]


def merge_splits(
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: int,
    num_splits: int,
) -> None:
    """out[token of each request, head] from the fp32 partial outputs [request, head, split, head_dim]
    and their base-2 log-sum-exps [request, head, split]; requests with no query token are skipped."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    _reduce_splits_kernel[(num_seqs, num_heads)](
        partial_out, partial_lse, out, query_start_loc, out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), EARLY=pdl.EARLY_READS,
        num_warps=4, **pdl.launch_args(out),
    )  # fmt: skip


def default_num_kv_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int | None,
    device: torch.device,
    programs_per_sm: int = 2,
    min_tokens_per_split: int = _MIN_TOKENS_PER_SPLIT,
) -> int:
    """KV splits for a decode: enough programs for programs_per_sm a multiprocessor, never a split under
    min_tokens_per_split tokens when max_seq_len is known. A power of two, so a server compiles at most
    six variants. Any count is correct for any lengths (the kernel splits by the seq_lens it reads), so a
    CUDA graph captured with one count stays valid when the lengths change."""
    splits = triton.cdiv(programs_per_sm * sm_count(device), max(num_seqs * num_kv_heads, 1))
    if max_seq_len is not None:
        splits = min(splits, triton.cdiv(max_seq_len, min_tokens_per_split))
    splits = max(1, min(splits, _MAX_KV_SPLITS))
    return 1 << (splits.bit_length() - 1)


def split_partials(
    num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 buffers a split decode writes and merge_splits reads: partial outputs [request, head,
    split, head_dim] and their log-sum-exps [request, head, split], flat."""
    rows = num_seqs * num_heads * num_splits
    return (
        torch.empty(rows * head_dim, dtype=torch.float32, device=device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )
