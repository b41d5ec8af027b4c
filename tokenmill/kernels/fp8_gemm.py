"""Triton W8A8 FP8 GEMM with row-wise scales: y = (a_q * a_scale) (w_q * w_scale)^T (+ bias), a_q e4m3
[M, K] with one scale per row (per token), w_q e4m3 [N, K] with one scale per output channel. For the
small batches decode runs at (17-64 rows: kernels.FP8_GEMM_MAX_ROWS), where cuBLAS's FP8 heuristics
pick tiles made for large squares: measured on an H200 at 32 rows of Llama-3.1-8B's linears, this
kernel takes 0.73-0.82x the time of torch._scaled_mm; at 128 rows and more it is no faster
(docs/performance.md, 2026-12-01), and cuBLAS keeps them.

The same kernel multiplies int8 operands (INT8 checkpoints' W8A8, layers/quantization/int8.py): int8
tensor-core products summed exactly in int32 on the GPU, then the same scales. (cuBLAS's int8 GEMM,
torch._int_mm, on the transposed view of the [N, K] weight gave exact sums on an H100 with torch 2.11,
but was no faster than this kernel at its tiles, and its int32 output takes another launch to scale:
bench_quant_gemm.py --int8-gemm, docs/performance.md 2026-12-06.)

Programs that share a weight tile are launched next to each other (M varies fastest), so a weight tile
comes from HBM once and from L2 for the other row tiles. Rows and columns past the ends read a copy of
the last row or column (no masks, so the loads stay vectorized) and are not stored; K is masked only
when it is not a multiple of the tile. Its reference is layers/quantization/fp8.py's fp8_linear_reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8_block_gemm import has_fp8_mma


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _fp8_rowwise_kernel(
    a,
    a_scale,
    w,
    w_scale,
    bias,
    out,
    M,
    N,
    K,
    stride_am,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP8_DOT: tl.constexpr,
    INT8_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % tiles_m
    pid_n = pid // tiles_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = a + (rm % M)[:, None] * stride_am + rk[None, :]
    w_ptr = w + (rn % N)[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32 if INT8_DOT else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            at = tl.load(a_ptr)
            wt = tl.load(w_ptr)
        else:
            k_ok = (k0 + rk < K)[None, :]
            at = tl.load(a_ptr, mask=k_ok, other=0.0)
            wt = tl.load(w_ptr, mask=k_ok, other=0.0)
        if INT8_DOT:  # int8 products summed exactly in int32
            acc = tl.dot(at, tl.trans(wt), acc, out_dtype=tl.int32)
        elif FP8_DOT:
            # Hopper's FP8 tensor cores sum with fewer bits than fp32; each tile's products join the
            # fp32 sum after BLOCK_K of them (as cuBLAS does without fast accumulation).
            acc = tl.dot(at, tl.trans(wt), acc, max_num_imprecise_acc=BLOCK_K)
        else:  # e4m3 and int8 are exact in fp32: the interpreter and pre-Hopper paths multiply there
            acc = tl.dot(at.to(tl.float32), tl.trans(wt.to(tl.float32)), acc, input_precision="ieee")
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    sa = tl.load(a_scale + rm % M)
    sw = tl.load(w_scale + rn % N)
    acc = acc.to(tl.float32) * sa[:, None] * sw[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rn % N).to(tl.float32)[None, :]
    o_mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(out + rm[:, None] * stride_om + rn[None, :], acc.to(out.dtype.element_ty), mask=o_mask)


def default_config(m: int, n: int, k: int, int8: bool = False) -> Fp8GemmConfig:
    """Tiles from the H200 sweep of benchmarks/gpu/bench_quant_gemm.py --fp8-gemm (Llama-3.1-8B's
    linears at 32-256 rows): narrow tiles, so that even a 4096-column weight gives every SM a program,
    and deep pipelines; wide ones for the widest weights (gate/up) once the batch passes 64 (for
    callers beyond the engine's FP8_GEMM_MAX_ROWS). int8 operands, which the engine sends here at every
    batch past 16 rows, past 128 rows take the H100 sweep's (--int8-gemm, 2026-12-06): 128 x 128 tiles at
    four warps and three stages from 512 rows and for the widest weights, 64 x 64 at four stages below
    (1.45-1.97x bf16 cuBLAS at 256 and 2048 rows, where the FP8 tiles gave 0.88-1.46x)."""
    if int8 and m > 128:
        if m >= 512 or n >= 16384:
            return Fp8GemmConfig(128, 128, 128, num_warps=4, num_stages=3)
        return Fp8GemmConfig(64, 64, 128, num_warps=4, num_stages=4)
    if n >= 16384:
        if m <= 64:
            return Fp8GemmConfig(64, 128, 128, num_warps=4, num_stages=4)
        # (128, 256) was 10% faster at 256 rows before the fp32 promotion; with it, it spills.
        return Fp8GemmConfig(128, 128, 128, num_warps=8, num_stages=4)
    if m <= 128:
        return Fp8GemmConfig(64, 64, 128, num_warps=4, num_stages=5)
    return Fp8GemmConfig(64, 128, 128, num_warps=4, num_stages=5)


def fp8_rowwise_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """a_q e4m3 [M, K], a_scale fp32 [M, 1] (or [M]); w_q e4m3 [N, K], w_scale fp32 [N, 1] (or [N]);
    returns [M, N] in out_dtype. a_q and w_q may both be int8 instead."""
    m, k = a_q.shape
    n = w_q.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a_q.device)
    if m == 0:
        return out
    if a_q.stride(1) != 1 or w_q.stride(1) != 1:
        raise ValueError("fp8_rowwise_gemm takes a_q and w_q with unit stride along K")
    int8 = a_q.dtype == torch.int8
    if int8 != (w_q.dtype == torch.int8):
        raise ValueError(
            f"fp8_rowwise_gemm takes both operands int8 or neither, got {a_q.dtype}, {w_q.dtype}"
        )
    config = config or default_config(m, n, k, int8)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_rowwise_kernel[grid](
        a_q, a_scale.reshape(-1), w_q, w_scale.reshape(-1), bias if bias is not None else out, out, m, n, k,
        a_q.stride(0), w_q.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, FP8_DOT=not int8 and a_q.is_cuda and has_fp8_mma(a_q.device),
        INT8_DOT=int8 and a_q.is_cuda,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out
