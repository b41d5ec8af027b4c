"""y = x W^T for a few rows of x (decode at small batch): a Triton kernel that streams W once.

At batch 1-16 a linear layer is a read of its weight matrix and nothing else; what matters is keeping
enough bytes in flight on every multiprocessor. Each program owns BLOCK_N output features for all rows
(up to 16, one tensor-core tile) and walks K in BLOCK_K steps through a software pipeline. Without
split-K there is nothing to reduce afterwards, so the layer is one launch, as with cuBLAS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 16


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Chosen by benchmarks/gpu/bench_skinny_gemm.py on the H200 (bf16, Llama-3.1-8B and Qwen3 shapes).
DEFAULT_CONFIG = SkinnyConfig(block_n=16, block_k=256, num_warps=4, num_stages=4)


@triton.jit
def _skinny_gemm_kernel(
    x,
    w,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w + offs_n[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            xt = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            if EVEN_N:
                wt = tl.load(w_ptrs)
            else:
                wt = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            mask_k = (k + offs_k) < K
            xt = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, config: SkinnyConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """x [M, K] (M <= 16) times weight [N, K] transposed, accumulated in fp32, in x's dtype."""
    num_rows, k = x.shape
    n = weight.shape[0]
    if num_rows > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows, got {num_rows}")
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    grid = (triton.cdiv(n, config.block_n),)
    _skinny_gemm_kernel[grid](
        x, weight, out, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0, NUM_STAGES=config.num_stages,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
    )  # fmt: skip
    return out
