"""Triton mixture-of-experts MLP: each token's top-k experts, each a gated SiLU MLP, weighted and summed.
The reference is kernels/reference.py's fused_moe, of the same signature.

The (token, slot) pairs are grouped by expert and each expert's run padded to a multiple of BLOCK_M
(`align_by_expert`: three small kernels of fixed shapes, no host sync, so CUDA graphs can hold it); then one
grouped GEMM over the blocks computes gate/up for every pair (each block reads its expert's weights
once), SiLU-and-mul, and a second grouped GEMM computes down and multiplies by the routing weight;
the k partial outputs of a token are summed last.
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


def pick_config(num_pairs: int, num_experts: int) -> tuple:
    """The CONFIGS row for num_pairs (token, slot) pairs over num_experts experts."""
    per_expert = num_pairs / num_experts
    return next(row for row in CONFIGS if per_expert <= row[0])


def _bins_and_chunk(num_experts: int) -> tuple[int, int]:
    bins = triton.next_power_of_2(num_experts)
    return bins, max(16, min(128, 8192 // bins))


@triton.jit
def _count_kernel(
    experts, counts, num_pairs, NUM_EXPERTS: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr
):  # noqa: E501
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
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded):
        return
    expert = tl.load(block_experts + pid_m).to(tl.int64)
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs + offs)
    valid = pair < num_pairs
    row = pair // TOP_K if A_BY_TOKEN else pair
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
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


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; experts and weights [T, k] (weights
    in x's dtype; an expert id of E: no expert here) -> [T, H]."""
    num_tokens, top_k = experts.shape
    _, block_m, gate_up_config, down_config = pick_config(num_tokens * top_k, w13.shape[0])
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    layout = (
        *align_by_expert(experts, w13.shape[0], block_m),
        weights.reshape(-1).contiguous(),
        top_k,
        block_m,
    )
    gate_up = x.new_empty(num_tokens * top_k, w13.shape[1])  # (rows of no expert here: never read)
    _gemm(x, w13, gate_up, layout, True, False, gate_up_config)
    hidden = silu_and_mul(gate_up)
    down = x.new_zeros(num_tokens * top_k, w2.shape[1])  # pairs of no expert here stay zero
    _gemm(hidden, w2, down, layout, False, True, down_config)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
