"""Triton dequantization of 8-bit weights in groups: w_q int8 (or e4m3) [N, K], scale [N, groups], zero
points int8 [N, groups] or none -> (q - zero) * scale [N, K] in bf16 or fp16, one pass (a byte read and
two written per value). GPTQ's 8-bit and INT8 weight-only linears take it past the batches their W8A16
kernels serve (layers/quantization/int8.py): there the GEMM's arithmetic outweighs this pass, and cuBLAS
multiplies the result. The torch expression it replaces spent six passes with fp32 intermediates and an
index gather of the scales (25x the bf16 GEMM at 256 rows on an H100). Its reference is
kernels/quant_reference.py's dequantize_8bit_groups, of the same signature, bit for bit: both compute
(q - zero) * scale in fp32 and round once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32
BLOCK_K = 128


@triton.jit
def _dequantize_kernel(
    w_q,
    scale,
    zero,
    out,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_on,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    ok = n_ok[:, None] & (rk < K)[None, :]
    rows = rn.to(tl.int64)[:, None]
    q = tl.load(w_q + rows * stride_wn + rk[None, :], mask=ok).to(tl.float32)  # (masked: not stored)
    w = scale_by_group(q, scale, zero, rn, n_ok, rk, ok, tl.program_id(1) * BLOCK_K, stride_sn, stride_zn,
                       GROUP, BLOCK_K, HAS_ZERO)  # fmt: skip
    tl.store(out + rows * stride_on + rk[None, :], w.to(out.dtype.element_ty), mask=ok)


@triton.jit
def scale_by_group(
    q, scale, zero, rn, n_ok, rk, ok, first, stride_sn, stride_zn,
    GROUP: tl.constexpr, TILE: tl.constexpr, HAS_ZERO: tl.constexpr,
):  # fmt: skip
    """(q - zero) * scale in fp32 for a tile of values q [rows rn, TILE columns rk from `first`]: one
    scale (and zero point) a row where the tile lies inside one group, else each column's own (the
    4-bit dequantization, kernels/int4_gemm.py, takes it too)."""
    if GROUP % TILE == 0:
        group = first // GROUP
        s = tl.load(scale + rn * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if HAS_ZERO:
            q -= tl.load(zero + rn * stride_zn + group, mask=n_ok, other=0).to(tl.float32)[:, None]
    else:
        groups = rk // GROUP
        s = tl.load(scale + rn[:, None] * stride_sn + groups[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            q -= tl.load(zero + rn[:, None] * stride_zn + groups[None, :], mask=ok, other=0).to(tl.float32)
    return q * s


def dequantize_8bit_groups(
    w_q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The [N, K] weight in `dtype` (see the module's docstring). One group of all K columns (scale
    [N, 1]) is the per-channel case."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dequant8.dequantize_8bit_groups writes bf16 or fp16, not {dtype}")
    n, k = w_q.shape
    if w_q.stride(1) != 1:
        w_q = w_q.contiguous()
    if scale.shape[1] == 1:  # per channel: every column in group 0 (a whole number of tiles)
        group_size = triton.cdiv(max(k, 1), BLOCK_K) * BLOCK_K
    out = torch.empty(n, k, dtype=dtype, device=w_q.device)
    if n and k:
        grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
        _dequantize_kernel[grid](
            w_q, scale, zero if zero is not None else scale, out, n, k, w_q.stride(0), scale.stride(0),
            zero.stride(0) if zero is not None else 0, out.stride(0),
            GROUP=group_size, HAS_ZERO=zero is not None, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
        )  # fmt: skip
    return out
