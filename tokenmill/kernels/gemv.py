"""The one-row kernels (batch-1 decode) behind kernels/skinny_gemm.py's wrappers: one row of activations
against a 4-bit, FP8 or dense 16-bit weight, the products summed elementwise in an fp32 tile and reduced
once at the end, with no tensor-core tile to pad. Also the helpers the several-row kernels share.

A 4-bit value becomes a float by the exponent trick (0x4B000000 | q is 2^23 + q as fp32), not an
int-to-float conversion, which runs at a quarter of the FMA rate; here the value is not even shifted
down (see the kernel). Measured on an H200 (benchmarks/gpu/bench_quant_gemm.py): that 4-bit kernel is
bound by these integer and float instructions, not by memory, so every one out of the inner loop
counts; 16-bit activations take kernels/gemv_f16x2.py's kernel instead, which multiplies in packed fp16
halves. SPLIT_K > 1 sums partial products in an fp32 buffer with atomic adds, for matrices with too few
rows to fill the GPU. The 16-bit/FP8 kernel and the packed-fp16 one can also do a gate/up projection's
SiLU-and-multiply as they store its output (store_row): kernels.GemvFusion, asked for by
layers/fused_linear.py (GEMV_FUSION, on by default).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels import GemvFusion, pdl

# The exponent trick's bit pattern: 0x4B000000 | m is the fp32 2^23 + m for m < 2^23. Passed as a kernel
# argument, not a literal, so that it sits in a register: then (word & mask) | magic is one LOP3 (three
# operands, one immediate) instead of two.
MAGIC = 0x4B000000


@triton.jit
def widen(wt):
    """A weight tile as fp32; int8 by bit operations, exactly, not by the int-to-float conversion, which
    runs at a quarter of the FMA rate (one a value: in sm_90 SASS the one-row int8 kernel's I2Fs
    outnumbered its FFMAs): q with its sign bit flipped, ORed into 2^23's pattern, is the fp32
    2^23 + 128 + q (one XOR does both), less 2^23 + 128. e4m3 stays with the hardware's conversion,
    F2FP, two values an instruction: placing its fields in fp32's by shifts and masks took some six
    integer instructions a value in the SASS, more than that costs."""
    if wt.dtype == tl.int8:
        return int8_biased(wt) - INT8_BIAS
    else:
        return wt.to(tl.float32)


INT8_BIAS = tl.constexpr(8388736.0)  # 2^23 + 128


@triton.jit
def int8_biased(wt):
    """An int8 tile q as the fp32 INT8_BIAS + q, exact, by one XOR (widen's trick, its subtraction left
    to the caller, which may fold a zero point into it)."""
    b = wt.to(tl.uint8, bitcast=True).to(tl.uint32)
    return (b ^ 0x4B000080).to(tl.float32, bitcast=True)


@triton.jit
def store(out, result, rm, rn, m_ok, n_ok, stride_om, SPLIT_K: tl.constexpr):
    """result [BLOCK_M, BLOCK_N] into out's rows rm and columns rn: stored, or with split K added to the
    fp32 partial sums of the other programs."""
    o_mask = m_ok[:, None] & n_ok[None, :]
    o_offsets = rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out + o_offsets, result.to(out.dtype.element_ty), mask=o_mask)
    else:
        tl.atomic_add(out + o_offsets, result, mask=o_mask)


@triton.jit
def store_row(out, result, rn, n_ok, N_OUT, SPLIT_K: tl.constexpr, GATED: tl.constexpr, HALF: tl.constexpr):
    """A one-row program's sums `result` [BLOCK_N] into out's columns rn (store's rules). GATED (no K
    split; program_rows): the first HALF sums are gate rows and the rest the up rows of the same HALF
    outputs, stored as silu(gate) * up with the roundings of the separate launches
    (kernels/activation.py) into the program's N_OUT columns."""
    if GATED:
        pair = tl.reshape(result.to(out.dtype.element_ty).to(tl.float32), (2, HALF))
        which = tl.arange(0, 2)[:, None]
        gate = tl.sum(tl.where(which == 0, pair, 0.0), axis=0)
        up = tl.sum(tl.where(which == 1, pair, 0.0), axis=0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out.dtype.element_ty).to(tl.float32)
        cols = tl.program_id(0) * HALF + tl.arange(0, HALF)
        tl.store(out + cols, (silu * up).to(out.dtype.element_ty), mask=cols < N_OUT)
    else:
        rm = tl.arange(0, 1)
        store(out, result[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


@triton.jit
def span(units, pid_k, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """[lo, hi) of the `units` (words or values along K) that split pid_k sums, in whole blocks."""
    span = tl.cdiv(tl.cdiv(units, SPLIT_K), BLOCK) * BLOCK
    lo = pid_k * span
    return lo, tl.minimum(lo + span, units)


@triton.jit
def program_rows(w, N, units, stride_wn, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
                  PDL: tl.constexpr, EARLY: tl.constexpr, GATED: tl.constexpr):  # fmt: skip
    """A one-row program's weight rows (for the loads of weights and scales; rows past N read a copy of
    another, never stored), its output columns, whether each is real, the pointers to the first BLOCK
    units of its weight rows and its [lo, hi) along K; then the PDL wait, after which the program may
    read x (with EARLY the caller waits, after loading its first weight tiles: the weights are no
    earlier kernel's output). GATED: the weight is gate || up (N / 2 rows each) and the program takes
    gate rows j..j + BLOCK_N / 2 and the up rows of the same j (store_row combines them)."""
    r = tl.arange(0, BLOCK_N)
    if GATED:
        half = N // 2
        rn = tl.program_id(0) * (BLOCK_N // 2) + r % (BLOCK_N // 2)
        n_ok = rn < half
        rows = tl.where(n_ok, tl.where(r < BLOCK_N // 2, rn, half + rn), 0)
    else:
        rn = tl.program_id(0) * BLOCK_N + r
        n_ok = rn < N
        rows = rn % N
    base = w + rows[:, None] * stride_wn + tl.arange(0, BLOCK)[None, :]
    lo, hi = span(units, tl.program_id(1), SPLIT_K, BLOCK)
    if not EARLY:
        pdl.start(PDL)
    return rows, rn, n_ok, base, lo, hi


@triton.jit
def w4a16_gemv_kernel(
    x,
    w_packed,
    scale,
    zero,
    out,
    N,
    K,
    stride_wn,
    stride_sn,
    stride_zn,
    magic,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    SUB: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of x against BLOCK_N rows of the packed weight; BLOCK_W words (8 values each) per step.

    Per weight value the loop spends three instructions: LOP3 (the nibble where it lies, OR the magic),
    FFMA ((2^23 + q 2^sh) 2^-sh - (2^23 + 8) = q - 8, exact), FFMA (times x_i into the tile's sum). The
    scale is applied once per SUB words (one group), the zero point once per SUB words through the sum
    of x. With EVEN_K no load is masked along K (the loads stay 16-byte vectors); rows past N read row
    N-1's copy and are not stored."""
    rn_ld, rn, n_ok, base, lo, hi = program_rows(
        w_packed, N, tl.cdiv(K, 8), stride_wn, BLOCK_N, BLOCK_W, SPLIT_K, PDL, False, False
    )
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W // SUB], dtype=tl.float32)
    for w0 in tl.range(lo, hi, BLOCK_W, loop_unroll_factor=UNROLL):
        w0 = tl.multiple_of(w0, BLOCK_W)
        rw = w0 + cols
        if EVEN_K:
            packed = tl.load(base + w0)
        else:
            packed = tl.load(base + w0, mask=(rw < hi)[None, :], other=0)
        # Nibble i is read where it lies, not shifted down: sh = 4i stays below 20 (the mantissa), so
        # nibbles 5-7 come from the word shifted right by 12.
        high = packed >> 12
        part = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
        for i in tl.static_range(8):
            k = rw * 8 + i
            if EVEN_K:
                xi = tl.load(x + k).to(tl.float32)
            else:
                xi = tl.load(x + k, mask=k < K, other=0.0).to(tl.float32)
            if i < 5:
                bits = (packed & (0xF << (4 * i))) | magic
                down = 1.0 / (1 << (4 * i))
            else:
                bits = (high & (0xF << (4 * i - 12))) | magic
                down = 1.0 / (1 << (4 * i - 12))
            if HAS_ZERO:  # q; the zero (stored minus 8) leaves through x's sum below
                q = bits.to(tl.float32, bitcast=True) * down - 8388608.0 * down
                x_sum += xi
            else:  # q - 8
                q = bits.to(tl.float32, bitcast=True) * down - (8388608.0 * down + 8.0)
            part += q * xi[None, :]
        if SUB > 1:
            part = tl.sum(tl.reshape(part, (BLOCK_N, BLOCK_W // SUB, SUB)), axis=2)
            x_sum = tl.sum(tl.reshape(x_sum, (BLOCK_W // SUB, SUB)), axis=1)
        rs = w0 + tl.arange(0, BLOCK_W // SUB) * SUB
        group = (rs * 8) // GROUP
        s_ok = (rs < hi)[None, :]
        s = tl.load(scale + rn_ld[:, None] * stride_sn + group[None, :], mask=s_ok, other=0.0)
        if HAS_ZERO:
            z = tl.load(zero + rn_ld[:, None] * stride_zn + group[None, :], mask=s_ok, other=0)
            part -= (z.to(tl.float32) + 8.0) * x_sum[None, :]
        acc += s.to(tl.float32) * part
    rm = tl.arange(0, 1)
    store(out, tl.sum(acc, axis=1)[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


@triton.jit
def w8a16_gemv_kernel(
    x,
    w,
    w_scale,
    out,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    VEC: tl.constexpr,
    EARLY: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS rows of x (one, or a few: each weight tile converted once for all of them) against BLOCK_N
    rows of e4m3 weights (HAS_SCALE: the row scale applied to the sum) or of 16-bit ones (no scale; VEC
    values to a 16-byte load: 16 or 8): products summed in fp32 registers and reduced across threads once
    at the end. (A tile of 8-bit values carried across iterations, as a register prefetch would, is held
    a byte per register: the repacking costs more than the overlap gains, seen in the SASS. Unrolling
    puts the loads in flight together instead.) EARLY (EVEN_K, under PDL; at most the program's tiles):
    the first EARLY tiles of weights are loaded before the PDL wait, while the kernel before still runs,
    and multiplied once x may be read; the loop takes the rest. GATED: store_row stores silu(gate) * up
    of the sums (with program_rows' rows)."""
    rn_ld, rn, n_ok, base, lo, hi = program_rows(
        w, N, K, stride_wn, BLOCK_N, BLOCK_K, SPLIT_K, PDL, EARLY, GATED
    )
    cols = tl.arange(0, BLOCK_K)
    accs = ()
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32),)
    start = lo
    if EARLY:
        firsts = ()
        for i in tl.static_range(EARLY):
            firsts = firsts + (tl.load(base + lo + i * BLOCK_K),)
        pdl.start(PDL)
        for i in tl.static_range(EARLY):
            rk = lo + i * BLOCK_K + cols
            accs = _w8_step(firsts[i], x, stride_xm, rk, hi, accs, ROWS, BLOCK_N, BLOCK_K, VEC, True)
        start = lo + EARLY * BLOCK_K
    for k0 in tl.range(start, hi, BLOCK_K, loop_unroll_factor=UNROLL):
        k0 = tl.multiple_of(k0, BLOCK_K)
        rk = k0 + cols
        if EVEN_K:
            wt = tl.load(base + k0)
        else:
            wt = tl.load(base + k0, mask=(rk < hi)[None, :], other=0.0)
        accs = _w8_step(wt, x, stride_xm, rk, hi, accs, ROWS, BLOCK_N, BLOCK_K, VEC, EVEN_K)
    for r in tl.static_range(ROWS):
        result = tl.sum(accs[r], axis=1)
        if HAS_SCALE:
            result *= tl.load(w_scale + rn_ld)
        store_row(out + r * stride_om, result, rn, n_ok, N // 2, SPLIT_K, GATED, BLOCK_N // 2)


@triton.jit
def _w8_step(wt, x, stride_xm, rk, hi, accs, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             VEC: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """One step of w8a16_gemv_kernel: the weight tile wt [BLOCK_N, BLOCK_K] (columns rk) in fp32, times
    each row's activations, summed into that row's accumulator; returns the accumulators."""
    w32 = widen(wt)
    new_accs = ()
    for r in tl.static_range(ROWS):
        # x is loaded as a [BLOCK_N, BLOCK_K] tile (each thread reads the x values of its own weight
        # values; copies for other rows hit L1): in the weight's layout, with no exchange through
        # shared memory and no barrier, which would keep the unrolled iterations' loads apart.
        x_ptr = x + r * stride_xm + tl.broadcast_to(rk[None, :], (BLOCK_N, BLOCK_K))
        if EVEN_K:
            xk = tl.load(x_ptr)
        else:
            xk = tl.load(x_ptr, mask=(rk < hi)[None, :], other=0.0)
        # Each thread holds VEC consecutive values (one 16-byte load): summed there, the tile that is
        # carried across iterations is a VEC-th of the loaded one.
        product = w32 * xk.to(tl.float32)
        new_accs = new_accs + (accs[r] + tl.sum(tl.reshape(product, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2),)
    return new_accs


class Fused(NamedTuple):
    """A GemvFusion as a one-row launch takes it (fused_args)."""

    gated: bool  # the kernel stores silu(gate) * up itself (GATED)
    act_after: bool  # silu(gate) * up in a launch of its own (K split, or a bias first)


def fused_args(fusion: GemvFusion | None, n: int, split_k: int, bias: torch.Tensor | None) -> Fused:
    """How the one-row kernels take `fusion` for n outputs, and what launch_over_rows does after the
    launch: the kernel stores silu(gate) * up itself unless K is split (its sums are partial) or a bias
    comes first."""
    silu_mul = fusion is not None and fusion.silu_mul
    if silu_mul and n % 2:
        raise ValueError("GemvFusion(silu_mul=True) takes an even number of outputs (gate || up)")
    in_kernel = split_k == 1 and bias is None
    return Fused(silu_mul and in_kernel, silu_mul and not in_kernel)
