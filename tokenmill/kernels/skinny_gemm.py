"""Triton GEMMs for a few rows of activations against a quantized weight: decode's shape, where the
step reads every weight once and the matmul is a matrix-vector product in all but name.

- w4a16_skinny: 4-bit weights in the pack-quantized layout of kernels/int4_gemm.py (int32 [N, K/8],
  each value stored as q + 8, group scales [N, K/group], optional int8 zero points).
- w8a16_skinny: e4m3 weights [N, K] with one fp32 scale per output row (online FP8 and per-channel or
  per-tensor checkpoints); activations stay in their own dtype: no quantization launch, no cuBLAS
  FP8 GEMM tuned for large tiles.

Both read the weight in wide rows (coalesced) and dequantize in registers. With one row of activations
(batch-1 decode) the products are summed elementwise in a [BLOCK_N, BLOCK_K] fp32 tile and reduced once
at the end, with no tensor-core tile to pad; with 2-16 rows through tl.dot. A 4-bit value becomes a
float by the exponent trick (0x4B000000 | q is 2^23 + q as fp32), not an int-to-float conversion, which
runs at a quarter of the FMA rate; at one row the value is not even shifted down (see the kernel).
Measured on an H200 (benchmarks/gpu/bench_quant_gemm.py): the 4-bit kernel is bound by these integer and
float instructions, not by memory, so every one out of the inner loop counts. SPLIT_K > 1 sums partial
products in an fp32 buffer with atomic adds, for matrices with too few rows to fill the GPU.

The references are kernels/reference.py's w4a16_gemm and w8a16_gemm (the launch hint aside, the same
signatures).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels import SKINNY_MAX_ROWS as MAX_ROWS
from tokenmill.kernels import k_splits


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int  # values along K per iteration (4-bit: eight to a word)
    split_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _store(out, result, rm, rn, m_ok, n_ok, stride_om, SPLIT_K: tl.constexpr):
    """result [BLOCK_M, BLOCK_N] into out's rows rm and columns rn: stored, or with split K added to the
    fp32 partial sums of the other programs."""
    o_mask = m_ok[:, None] & n_ok[None, :]
    o_offsets = rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(out + o_offsets, result, mask=o_mask)


@triton.jit
def _w4a16_skinny_kernel(
    x,
    w_packed,
    scale,
    zero,
    out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_zn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    words = tl.cdiv(K, 8)
    span = tl.cdiv(tl.cdiv(words, SPLIT_K), BLOCK_W) * BLOCK_W
    lo = pid_k * span
    hi = tl.minimum(lo + span, words)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for w0 in range(lo, hi, BLOCK_W):
        rw = w0 + tl.arange(0, BLOCK_W)
        w_ok = rw < hi
        nw_ok = n_ok[:, None] & w_ok[None, :]
        packed = tl.load(w_packed + rn[:, None] * stride_wn + rw[None, :], mask=nw_ok, other=0)
        group = (rw * 8) // GROUP
        s = tl.load(scale + rn[:, None] * stride_sn + group[None, :], mask=nw_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            z = tl.load(zero + rn[:, None] * stride_zn + group[None, :], mask=nw_ok, other=0).to(tl.float32)
            z = z + 8.0
        else:
            z = 8.0
        if BLOCK_M == 1:
            # Nibble i is read where it lies, not shifted down: (word & 0xF << sh) | 0x4B000000 is the
            # fp32 2^23 + q * 2^sh, so one LOP3 and one FADD make q * 2^sh, and x_i * 2^-sh (once per x
            # element, not per weight) undoes the power. sh stays below 20 (the mantissa): nibbles 5-7
            # come from the word shifted right by 12.
            high = packed >> 12
            part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
            for i in tl.static_range(8):
                k = rw * 8 + i
                xi = tl.load(x + k, mask=w_ok & (k < K), other=0.0).to(tl.float32)
                x_sum += xi
                if i < 5:
                    bits = (packed & (0xF << (4 * i))) | 0x4B000000
                    xi = xi * (1.0 / (1 << (4 * i)))
                else:
                    bits = (high & (0xF << (4 * i - 12))) | 0x4B000000
                    xi = xi * (1.0 / (1 << (4 * i - 12)))
                part += (bits.to(tl.float32, bitcast=True) - 8388608.0) * xi[None, :]
            # sum_i (q_i - z) x_i s = s (sum_i q_i x_i - z sum_i x_i): the zero leaves the inner loop.
            acc += s * (part - z * x_sum[None, :])
        else:
            for i in tl.static_range(8):
                k = rw * 8 + i
                xi = tl.load(
                    x + rm[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & (w_ok & (k < K))[None, :],
                    other=0.0,
                )
                q = (((packed >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                w = ((q - z) * s).to(xi.dtype)
                acc = tl.dot(xi, tl.trans(w), acc, input_precision=PRECISION)
    if BLOCK_M == 1:
        result = tl.sum(acc, axis=1)[None, :]
    else:
        result = acc
    _store(out, result, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


@triton.jit
def _w8a16_skinny_kernel(
    x,
    w,
    w_scale,
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
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    lo = pid_k * span
    hi = tl.minimum(lo + span, K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < hi
        wt = tl.load(w + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_M == 1:
            xk = tl.load(x + rk, mask=k_ok, other=0.0).to(tl.float32)
            acc += wt.to(tl.float32) * xk[None, :]
        else:
            xk = tl.load(
                x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            acc = tl.dot(xk, tl.trans(wt.to(xk.dtype)), acc, input_precision=PRECISION)
    s = tl.load(w_scale + rn, mask=n_ok, other=0.0)
    if BLOCK_M == 1:
        result = (tl.sum(acc, axis=1) * s)[None, :]
    else:
        result = acc * s[None, :]
    _store(out, result, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


def default_config(m: int, n: int, k: int, bits: int, device: torch.device) -> SkinnyConfig:
    """Tiles for m rows of a [n, k] weight, from the H200 sweep of benchmarks/gpu/bench_quant_gemm.py
    (Llama-3.1-8B's linears at one row): many small programs, each reading wide rows along K; K split
    only for long rows over few outputs (down_proj), where the grid would otherwise be too small."""
    if bits == 4:
        if m == 1:
            return SkinnyConfig(8, 1024, 1, num_warps=2, num_stages=4)
        config = SkinnyConfig(32, 512, 1, num_warps=4, num_stages=3)
    elif m == 1:
        if k >= 8192:
            return SkinnyConfig(32, 256, 4, num_warps=4, num_stages=3)
        if n >= 16384:
            return SkinnyConfig(16, 256, 1, num_warps=4, num_stages=3)
        return SkinnyConfig(16, 512, 1, num_warps=8, num_stages=3)
    else:
        config = SkinnyConfig(32, 256, 1, num_warps=4, num_stages=3)
    tiles = triton.cdiv(n, config.block_n)
    return config._replace(split_k=k_splits(tiles, k, config.block_k, device, limit=8))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] with unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor, x2: torch.Tensor, n: int, config: SkinnyConfig, kernel, args: tuple, sizes: tuple,
    bias: torch.Tensor | None, **constexprs,
) -> torch.Tensor:  # fmt: skip
    """Runs `kernel` (args, out, sizes and strides, out's row stride) over the [n] outputs of x2's rows in
    config's tiles; returns [..., n] in x's dtype, bias added."""
    m = x2.shape[0]
    if config.split_k > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(n, config.block_n), config.split_k)
        kernel[grid](
            *args, out, *sizes, out.stride(0),
            BLOCK_M=1 if m == 1 else MAX_ROWS, BLOCK_N=config.block_n, SPLIT_K=config.split_k,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=config.num_warps, num_stages=config.num_stages, **constexprs,
        )  # fmt: skip
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def w4a16_skinny(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ W^T -> [..., N] in x's dtype; group_size a multiple of 8."""
    x2 = _rows(x)
    m, k = x2.shape
    n = w_packed.shape[0]
    if m > MAX_ROWS or group_size % 8:
        raise ValueError(f"w4a16_skinny takes at most {MAX_ROWS} rows and groups of a multiple of 8")
    config = config or default_config(m, n, k, 4, x.device)
    if m > 1 and config.block_k < 128:
        raise ValueError("w4a16_skinny: more than one row takes block_k >= 128 (tl.dot needs 16 words)")
    args = (x2, w_packed, scale, zero if zero is not None else scale)
    strides = (x2.stride(0), w_packed.stride(0), scale.stride(0), zero.stride(0) if zero is not None else 0)
    return _launch(
        x, x2, n, config, _w4a16_skinny_kernel, args, (m, n, k, *strides), bias,
        GROUP=group_size, HAS_ZERO=zero is not None, BLOCK_W=config.block_k // 8,
    )  # fmt: skip


def w8a16_skinny(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ (w_q * w_scale)^T -> [..., N] in x's dtype: w_q e4m3 [N, K],
    w_scale fp32 with one value per row ([N] or [N, 1])."""
    x2 = _rows(x)
    m, k = x2.shape
    n = w_q.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"w8a16_skinny takes at most {MAX_ROWS} rows")
    config = config or default_config(m, n, k, 8, x.device)
    if m > 1 and config.block_k < 16:
        raise ValueError("w8a16_skinny: more than one row takes block_k >= 16 (tl.dot's least K)")
    args = (x2, w_q, w_scale.reshape(-1).float())
    return _launch(
        x, x2, n, config, _w8a16_skinny_kernel, args, (m, n, k, x2.stride(0), w_q.stride(0)), bias,
        BLOCK_K=config.block_k,
    )  # fmt: skip
