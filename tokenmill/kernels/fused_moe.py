"""Triton mixture-of-experts MLP: each token's top-k experts, each a gated SiLU MLP, weighted and summed.
The reference is kernels/reference.py's fused_moe, of the same signature.

The (token, slot) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`align_by_expert`, torch ops of fixed shapes: no host sync, so CUDA graphs can hold it); then one
grouped GEMM over the blocks computes gate/up for every pair (each block reads its expert's weights
once), SiLU-and-mul, and a second grouped GEMM computes down and multiplies by the routing weight;
the k partial outputs of a token are summed last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.activation import silu_and_mul


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """experts [T, k] -> (pairs [P], block_experts [B], num_padded [1]): the flat pair indices t*k+slot
    sorted by expert, each expert's run padded with T*k to a multiple of block_m; the expert of each
    block of block_m pairs; how many entries the experts' runs fill (the blocks past it are skipped). An
    expert id of num_experts means no expert here (another rank's): its pairs sort last and are skipped.
    P and B are the most padding can need, T*k + (E+1)*(block_m-1) and its blocks, so the shapes depend
    on T alone."""
    flat = experts.reshape(-1)
    num_pairs = flat.numel()
    bins = num_experts + 1  # the last: no expert here
    size = num_pairs + bins * (block_m - 1)
    num_blocks = triton.cdiv(size, block_m)
    # (bincount would read the largest id back to size its output: a host sync)
    counts = torch.zeros(bins, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # Rank of each sorted pair within its expert's run: its sorted position minus where the run began.
    run_begin = torch.cumsum(counts, 0) - counts
    position = (
        torch.arange(num_pairs, device=flat.device) - run_begin[sorted_experts] + starts[sorted_experts]
    )
    pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=flat.device)
    pairs[position] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    return pairs, block_experts, ends[num_experts - 1 : num_experts].to(torch.int32)


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


def _gemm(a, w, out, pairs, block_experts, num_padded, weights, top_k, by_token, weighted, block_m) -> None:
    num_experts, n, k = w.shape
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm[grid](
        a, w, out, pairs, block_experts, num_padded, weights, n, k, out.shape[0],
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_BY_TOKEN=by_token, WEIGHTED=weighted,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up); w2 [E, H, I]; experts and weights [T, k] (weights
    in x's dtype; an expert id of E: no expert here) -> [T, H]."""
    num_tokens, top_k = experts.shape
    block_m = 16 if num_tokens * top_k <= 1024 else 64
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    pairs, block_experts, num_padded = align_by_expert(experts, w13.shape[0], block_m)
    flat_weights = weights.reshape(-1).contiguous()
    gate_up = x.new_empty(num_tokens * top_k, w13.shape[1])  # (rows of no expert here: never read)
    _gemm(x, w13, gate_up, pairs, block_experts, num_padded, flat_weights, top_k, True, False, block_m)
    hidden = silu_and_mul(gate_up)
    down = x.new_zeros(num_tokens * top_k, w2.shape[1])  # pairs of no expert here stay zero
    _gemm(hidden, w2, down, pairs, block_experts, num_padded, flat_weights, top_k, False, True, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
