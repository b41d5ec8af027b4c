"""The tl.dot kernels behind kernels/skinny_gemm.py's wrappers for 2-16 rows of activations: a 4-bit
weight dequantized a nibble plane at a time (the exponent trick of kernels/gemv.py), an e4m3 (or int8)
weight taken to the activations' dtype, and an int8 weight in groups (GPTQ's 8-bit, from one row), each
tile through tl.dot; K split across programs where the grid would leave SMs idle (gemv.store adds the
partial sums)."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.kernels import gemv, pdl


@triton.jit
def _program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output columns and the activation rows, each with which of them are real."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    return rn, rn < N, rm, rm < M


@triton.jit
def w4a16_dot_kernel(
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
    magic,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """2-16 rows of x: each nibble's [BLOCK_N, BLOCK_W] plane is dequantized and goes through tl.dot."""
    pdl.start(PDL)
    rn, n_ok, rm, m_ok = _program_tile(M, N, BLOCK_M, BLOCK_N)
    lo, hi = gemv.span(tl.cdiv(K, 8), tl.program_id(1), SPLIT_K, BLOCK_W)
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
        for i in tl.static_range(8):
            k = rw * 8 + i
            xi = tl.load(
                x + rm[:, None] * stride_xm + k[None, :],
                mask=m_ok[:, None] & (w_ok & (k < K))[None, :],
                other=0.0,
            )
            q = (((packed >> (4 * i)) & 0xF) | magic).to(tl.float32, bitcast=True) - 8388608.0
            w = ((q - z) * s).to(xi.dtype)
            acc = tl.dot(xi, tl.trans(w), acc, input_precision=PRECISION)
    gemv.store(out, acc, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


@triton.jit
def w8a16_dot_kernel(
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
    PDL: tl.constexpr,
):
    """2-16 rows of x: the e4m3 (or int8) tile goes to x's dtype and through tl.dot; the row scale at the
    end. int8 widens through fp32 (exact either way; the interpreter's int8 -> bf16 cast is wrong; on
    sm_90 Triton makes int8 -> fp32 -> bf16 a few integer instructions without a conversion, fewer
    than gemv.widen's, seen in the SASS)."""
    pdl.start(PDL)
    rn, n_ok, rm, m_ok = _program_tile(M, N, BLOCK_M, BLOCK_N)
    lo, hi = gemv.span(K, tl.program_id(1), SPLIT_K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < hi
        wt = tl.load(w + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xk = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if w.dtype.element_ty == tl.int8:
            wt = wt.to(tl.float32)
        acc = tl.dot(xk, tl.trans(wt.to(xk.dtype)), acc, input_precision=PRECISION)
    s = tl.load(w_scale + rn, mask=n_ok, other=0.0)
    gemv.store(out, acc * s[None, :], rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


@triton.jit
def w8a16_group_dequant_kernel(
    x,
    w,
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
    ONE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """BLOCK_M rows of x (the third grid dimension's block) over int8 weights with a scale (and zero
    point) per row and group of GROUP input columns (GPTQ's 8-bit; per channel, ONE_GROUP: GROUP >= K).
    Each [BLOCK_N, BLOCK_K] tile (BLOCK_K divides GROUP, so a tile lies in one group) is dequantized in
    registers, (q - zero) * scale rounded to x's dtype as the dequantize-then-matmul path of larger
    batches rounds it, before a tl.dot that adds into one accumulator; per channel (q - zero) stays exact
    and the scale comes at the end. (Scaling each tile's sums instead made each tile wait on its MMA, and
    x, read for the dot and for the zero point's sum, left Triton's pipelined loads: 0.80-0.95x bf16 on
    an H100 where this runs at 1.02-1.44x, docs/performance.md 2026-12-06.) SWAP_AB computes the
    transposed product, W's tile the dot's first operand: Hopper's wgmma takes that one from registers,
    where the dequantized tile already is, and only x's from shared memory."""
    pdl.start(PDL)
    rn, n_ok, rm, m_ok = _program_tile(M, N, BLOCK_M, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + rm
    m_ok = rm < M
    lo, hi = gemv.span(K, tl.program_id(1), SPLIT_K, BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K  # (spans are whole tiles: only a tile across K's end has columns past it)
        wt = tl.load(w + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        xk = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # q - zero in one subtraction from gemv.int8_biased's INT8_BIAS + q (no int-to-float conversion).
        # Per channel without zero points q goes to x's dtype as it is, which Triton does in a few integer
        # instructions (the XOR's subtraction and repacking made INT8 weight-only 12-23% slower at 17 rows
        # on an H100, 2026-12-06).
        group = k0 // GROUP
        if HAS_ZERO:
            z = tl.load(zero + rn * stride_zn + group, mask=n_ok, other=0).to(tl.float32)
            wf = gemv.int8_biased(wt) - (z + gemv.INT8_BIAS)[:, None]
        elif ONE_GROUP:
            wf = wt.to(tl.float32)
        else:
            wf = gemv.widen(wt)
        if not ONE_GROUP:
            wf *= tl.load(scale + rn * stride_sn + group, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        if SWAP_AB:
            acc = tl.dot(wf.to(xk.dtype), tl.trans(xk), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xk, tl.trans(wf.to(xk.dtype)), acc, input_precision=PRECISION)
    if SWAP_AB:
        result = tl.trans(acc)
    else:
        result = acc
    if ONE_GROUP:
        result *= tl.load(scale + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    gemv.store(out, result, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)
