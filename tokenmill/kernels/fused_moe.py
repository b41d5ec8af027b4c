"""Triton mixture-of-experts MLP: each token's top-k experts, each a gated SiLU MLP, weighted and summed.
The reference is kernels/reference.py's fused_moe, of the same signature.

The (token, slot) pairs are grouped by expert and each expert's run padded to a multiple of BLOCK_M
(`align_by_expert`: three small kernels of fixed shapes, no host sync, so CUDA graphs can hold it); then one
grouped GEMM over the blocks computes gate/up for every pair (each block reads its expert's weights
once), SiLU-and-mul, and a second grouped GEMM computes down and multiplies by the routing weight;
the k partial outputs of a token are summed last (`_combine_kernel`). The router's softmax and top-k
are one kernel too (`topk_softmax`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.activation import silu_and_mul

# (pairs per expert, at most) -> BLOCK_M, then (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gate/up GEMM
# and of the down GEMM; the first row whose bound the step's average pairs per expert fits. Swept on an
# H200 with Qwen3-30B-A3B's layer (benchmarks/gpu/bench_moe.py --sweep); other shapes take the same rows.
CONFIGS = (
    (0.125, 16, (32, 256, 4, 3), (64, 128, 4, 3)),
    (0.5, 16, (128, 128, 4, 3), (64, 128, 4, 3)),
    (2, 16, (64, 128, 4, 3), (32, 256, 4, 2)),
    (4, 16, (128, 256, 4, 2), (32, 256, 4, 2)),
    (8, 16, (128, 256, 4, 2), (128, 128, 4, 2)),
    (16, 32, (128, 128, 4, 2), (128, 128, 4, 3)),
    (32, 64, (128, 64, 8, 3), (128, 64, 8, 4)),
    (64, 128, (128, 64, 8, 3), (128, 64, 8, 3)),
    (float("inf"), 128, (256, 64, 8, 3), (256, 64, 8, 3)),
)


# The same for INT4 experts (kernels/fused_moe_quant.py; BLOCK_K counts values, eight to a word): CONFIGS'
# rows but where the H100 sweep of the same layer (bench_moe.py --sweep --weights int4, 2026-12-06) gave
# tiles that the whole layer then ran faster with, symmetric and with zero points alike: at 64 tokens
# (-9% / -7%), 256 (-4% / 0) and 4,096 (-17% / -24%). Its picks for 8 and 1,024 tokens were no faster
# for symmetric groups and slower with zero points, and are not taken (docs/performance.md).
INT4_CONFIGS = (
    *(row for row in CONFIGS if row[0] <= 2),
    (4, 16, (128, 128, 4, 2), (128, 128, 4, 2)),
    *(row for row in CONFIGS if row[0] == 8),
    (16, 64, (128, 128, 4, 3), (128, 128, 4, 3)),
    *(row for row in CONFIGS if 16 < row[0] < float("inf")),
    (float("inf"), 128, (128, 128, 4, 2), (128, 64, 8, 5)),
)


def pick_config(num_pairs: int, num_experts: int, int4: bool = False) -> tuple:
    """The CONFIGS (INT4 experts: INT4_CONFIGS) row for num_pairs (token, slot) pairs over num_experts
    experts."""
    per_expert = num_pairs / num_experts
    return next(row for row in (INT4_CONFIGS if int4 else CONFIGS) if per_expert <= row[0])


def _bins_and_chunk(num_experts: int) -> tuple[int, int]:
    bins = triton.next_power_of_2(num_experts)
    return bins, max(16, min(128, 8192 // bins))


@triton.jit
def _count_kernel(
    experts, counts, num_pairs, NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr
):
    """counts[e] += the pairs of one chunk that chose expert e."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(experts + offs, mask=offs < num_pairs, other=NUM_EXPERTS)
    bins = tl.arange(0, BINS)
    hits = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.atomic_add(counts + bins, hits, mask=(bins < NUM_EXPERTS) & (hits > 0))


@triton.jit
def _layout_kernel(
    counts,
    cursor,
    pairs,
    block_experts,
    num_padded,
    num_pairs,
    num_blocks,
    NUM_EXPERTS: tl.constexpr,
    BINS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """One program: each expert's run padded to BLOCK_M, where it starts (cursor), the expert of each
    block, and every slot of pairs set to the sentinel num_pairs (the place kernel overwrites the real)."""
    bins = tl.arange(0, BINS)
    real = bins < NUM_EXPERTS
    padded = (tl.load(counts + bins, mask=real, other=0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(cursor + bins, ends - padded, mask=real)
    tl.store(num_padded, tl.sum(padded, axis=0))
    for b0 in range(0, num_blocks, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        # A block belongs to the first expert whose run ends past the block's start.
        expert = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_experts + blocks, tl.minimum(expert, NUM_EXPERTS), mask=blocks < num_blocks)
    sentinel = tl.zeros([1024], dtype=tl.int32) + num_pairs
    for s0 in range(0, num_blocks * BLOCK_M, 1024):
        slots = s0 + tl.arange(0, 1024)
        tl.store(pairs + slots, sentinel, mask=slots < num_blocks * BLOCK_M)


@triton.jit
def _place_kernel(
    experts, cursor, pairs, num_pairs, NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr
):
    """Each pair of one chunk into the next free slots of its expert's run: the chunk claims its slots
    with one atomic add per expert, then ranks its pairs within each expert."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_pairs
    e = tl.load(experts + offs, mask=valid, other=NUM_EXPERTS)
    bins = tl.arange(0, BINS)
    onehot = (e[:, None] == bins[None, :]).to(tl.int32)
    hits = tl.sum(onehot, axis=0)
    base = tl.atomic_add(cursor + bins, hits, mask=(bins < NUM_EXPERTS) & (hits > 0))
    base = tl.where(hits > 0, base, 0)
    position = tl.sum(onehot * (tl.cumsum(onehot, axis=0) - 1 + base[None, :]), axis=1)
    tl.store(pairs + position, offs.to(tl.int32), mask=valid & (e < NUM_EXPERTS))


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """experts [T, k] -> (pairs [P], block_experts [B], num_padded [1]): the flat pair indices t*k+slot
    grouped by expert, each expert's run padded with T*k to a multiple of block_m; the expert of each
    block of block_m pairs; how many entries the experts' runs fill (the blocks past it are skipped). An
    expert id of num_experts means no expert here (another rank's): its pairs get no slot. P and B are
    the most padding can need, T*k + E*(block_m-1) rounded up to blocks, so the shapes depend on T
    alone and nothing reads back to the host (CUDA graphs can hold it). Within an expert's run the
    pairs' order depends on which chunk claimed its slots first; each pair's output row does not."""
    flat = experts.reshape(-1).contiguous()
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    bins, chunk = _bins_and_chunk(num_experts)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_pairs, chunk),)
    _count_kernel[grid](flat, counts, num_pairs, NUM_EXPERTS=num_experts, BINS=bins, CHUNK=chunk)
    _layout_kernel[(1,)](
        counts, cursor, pairs, block_experts, num_padded, num_pairs, num_blocks,
        NUM_EXPERTS=num_experts, BINS=bins, BLOCK_M=block_m, CHUNK=max(16, 8192 // bins),
    )  # fmt: skip
    _place_kernel[grid](flat, cursor, pairs, num_pairs, NUM_EXPERTS=num_experts, BINS=bins, CHUNK=chunk)
    return pairs, block_experts, num_padded


@triton.jit
def _grouped_gemm(
    a,
    w,
    out,
    pairs,
    block_experts,
    num_padded,
    pair_weights,
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[pair] = a[row] @ w[expert]^T (times the pair's routing weight when WEIGHTED), for the pairs of
    one block of one expert; row is the pair's token (A_BY_TOKEN) or the pair itself."""
    if tl.program_id(0) * BLOCK_M >= tl.load(num_padded):
        return
    expert, pair, valid, row, rn, n_ok = block_pairs(
        pairs, block_experts, N, num_pairs, TOP_K, A_BY_TOKEN, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_expert = w + expert * stride_we
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        at = tl.load(
            a + row[:, None].to(tl.int64) * stride_am + rk[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        wt = tl.load(
            w_expert + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
        )
        acc += tl.dot(at, tl.trans(wt), input_precision=PRECISION)
    store_pairs(acc, out, pair, valid, rn, n_ok, pair_weights, stride_om, WEIGHTED)


@triton.jit
def block_pairs(
    pairs, block_experts, N, num_pairs, TOP_K: tl.constexpr, A_BY_TOKEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A grouped GEMM program's block: its expert, its pairs (and which are real), the rows of the
    activations they read (the pair's token, A_BY_TOKEN, or the pair itself) and its output columns."""
    expert = tl.load(block_experts + tl.program_id(0)).to(tl.int64)
    pair = tl.load(pairs + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs
    row = pair // TOP_K if A_BY_TOKEN else pair
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, pair, valid, row, rn, rn < N


@triton.jit
def store_pairs(acc, out, pair, valid, rn, n_ok, pair_weights, stride_om, WEIGHTED: tl.constexpr):
    """A block's fp32 sums into its pairs' output rows, times each pair's routing weight when WEIGHTED."""
    if WEIGHTED:
        acc = acc * tl.load(pair_weights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    o_mask = valid[:, None] & n_ok[None, :]
    tl.store(
        out + pair[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out.dtype.element_ty), mask=o_mask
    )


def _gemm(a, w, out, layout, by_token: bool, weighted: bool, config) -> None:
    """One grouped GEMM over layout = (pairs, block_experts, num_padded, pair weights, top_k, block_m)."""
    pairs, block_experts, num_padded, weights, top_k, block_m = layout
    _, n, k = w.shape
    block_n, block_k, num_warps, num_stages = config
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](
        a, w, out, pairs, block_experts, num_padded, weights, n, k, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=by_token, WEIGHTED=weighted,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


@triton.jit
def _topk_softmax_kernel(
    logits,
    experts_out,
    weights_out,
    num_tokens,
    num_experts,
    stride,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """ROWS tokens' softmax over the experts (fp32), then k rounds of taking the largest (the lowest
    index among equals) and striking it out; stored largest first."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    x = tl.load(
        logits + rows[:, None].to(tl.int64) * stride + cols[None, :],
        mask=row_ok[:, None] & (cols < num_experts)[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # (rows past the end: finite, never stored)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.where((cols < num_experts)[None, :], p, -1.0)
    p = p / tl.sum(tl.maximum(p, 0.0), axis=1)[:, None]
    slots = tl.arange(0, K_PAD)
    picked_w = tl.zeros([ROWS, K_PAD], dtype=tl.float32)
    picked_e = tl.zeros([ROWS, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        index = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)
        picked_w = tl.where(slots[None, :] == j, best[:, None], picked_w)
        picked_e = tl.where(slots[None, :] == j, index[:, None], picked_e)
        p = tl.where(cols[None, :] == index[:, None], -1.0, p)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(picked_w, axis=1)[:, None]
    out = rows[:, None].to(tl.int64) * TOP_K + slots[None, :]
    mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(experts_out + out, picked_e.to(experts_out.dtype.element_ty), mask=mask)
    tl.store(weights_out + out, picked_w.to(weights_out.dtype.element_ty), mask=mask)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.topk_softmax in one kernel (the torch ops it replaces are five launches a layer, the
    top-k a sort)."""
    num_tokens, num_experts = logits.shape
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=logits.dtype, device=logits.device)
    if num_tokens == 0:
        return experts, weights
    block_e = max(16, triton.next_power_of_2(num_experts))
    rows = max(1, min(16, 4096 // block_e))
    _topk_softmax_kernel[(triton.cdiv(num_tokens, rows),)](
        logits, experts, weights, num_tokens, num_experts, logits.stride(0),
        TOP_K=top_k, K_PAD=max(2, triton.next_power_of_2(top_k)), RENORMALIZE=renormalize,
        ROWS=rows, BLOCK_E=block_e,
    )  # fmt: skip
    return experts, weights


@triton.jit
def _combine_kernel(down, experts, out, H, num_experts, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = the sum over t's k pairs of their (already weighted) down rows; a pair of no expert
    here (id num_experts) adds nothing, and its row, never written, is never read."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        here = tl.load(experts + token * TOP_K + j) < num_experts
        row = tl.load(down + (token * TOP_K + j) * H + cols, mask=(cols < H) & here, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out + token * H + cols, acc.to(out.dtype.element_ty), mask=cols < H)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; experts and weights [T, k] (weights
    in x's dtype; an expert id of E: no expert here) -> [T, H]. w13 and w2 may be quantized
    (quant_reference.QuantExperts, run by kernels/fused_moe_quant.py)."""
    if isinstance(w13, torch.Tensor):
        gemm = _gemm
    else:
        from tokenmill.kernels.fused_moe_quant import quant_gemm as gemm
    num_tokens, top_k = experts.shape
    int4 = not isinstance(w13, torch.Tensor) and w13.int4
    _, block_m, gate_up_config, down_config = pick_config(num_tokens * top_k, w13.shape[0], int4)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    layout = (
        *align_by_expert(experts, w13.shape[0], block_m),
        weights.reshape(-1).contiguous(),
        top_k,
        block_m,
    )
    gate_up = x.new_empty(num_tokens * top_k, w13.shape[1])  # (rows of no expert here: never read)
    gemm(x, w13, gate_up, layout, True, False, gate_up_config)
    hidden = silu_and_mul(gate_up)
    down = x.new_empty(num_tokens * top_k, w2.shape[1])  # (rows of no expert here: never read)
    gemm(hidden, w2, down, layout, False, True, down_config)
    out = torch.empty_like(x)
    hidden_size = w2.shape[1]
    block_h = min(1024, triton.next_power_of_2(hidden_size))
    grid = (num_tokens, triton.cdiv(hidden_size, block_h))
    _combine_kernel[grid](down, experts, out, hidden_size, w13.shape[0], TOP_K=top_k, BLOCK_H=block_h)
    return out
