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

The references are kernels/quant_reference.py's w4a16_gemm and w8a16_gemm (the launch hint aside,
the same signatures).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels import SKINNY_MAX_ROWS as MAX_ROWS
from tokenmill.kernels import k_splits, pdl, sm_count


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int  # values along K per iteration (4-bit: eight to a word)
    split_k: int
    num_warps: int
    num_stages: int
    unroll: int = 1  # one row: K-loop iterations unrolled, so that their loads are in flight together


# The exponent trick's bit pattern: 0x4B000000 | m is the fp32 2^23 + m for m < 2^23. Passed as a kernel
# argument, not a literal, so that it sits in a register: then (word & mask) | magic is one LOP3 (three
# operands, one immediate) instead of two.
MAGIC = 0x4B000000


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
def _span(units, pid_k, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """[lo, hi) of the `units` (words or values along K) that split pid_k sums, in whole blocks."""
    span = tl.cdiv(tl.cdiv(units, SPLIT_K), BLOCK) * BLOCK
    lo = pid_k * span
    return lo, tl.minimum(lo + span, units)


@triton.jit
def _w4a16_gemv_kernel(
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
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_ld = rn % N
    lo, hi = _span(tl.cdiv(K, 8), pid_k, SPLIT_K, BLOCK_W)
    pdl.start(PDL)
    cols = tl.arange(0, BLOCK_W)
    base = w_packed + rn_ld[:, None] * stride_wn + cols[None, :]
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
    _store(out, tl.sum(acc, axis=1)[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


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
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    lo, hi = _span(tl.cdiv(K, 8), pid_k, SPLIT_K, BLOCK_W)
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
    _store(out, acc, rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


@triton.jit
def _w8a16_gemv_kernel(
    x,
    w,
    w_scale,
    out,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    UNROLL: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    VEC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row of x against BLOCK_N rows of e4m3 weights: products summed in fp32 registers and reduced
    across threads once at the end; the row scale applied to the sum. (A tile of 8-bit values carried
    across iterations, as a register prefetch would, is held a byte per register: the repacking costs
    more than the overlap gains, seen in the SASS. Unrolling puts the loads in flight together instead.)"""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rn_ld = rn % N
    lo, hi = _span(K, pid_k, SPLIT_K, BLOCK_K)
    pdl.start(PDL)
    cols = tl.arange(0, BLOCK_K)
    base = w + rn_ld[:, None] * stride_wn + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K // VEC], dtype=tl.float32)
    for k0 in tl.range(lo, hi, BLOCK_K, loop_unroll_factor=UNROLL):
        k0 = tl.multiple_of(k0, BLOCK_K)
        rk = k0 + cols
        # x is loaded as a [BLOCK_N, BLOCK_K] tile (each thread reads the x values of its own weight
        # values; copies for other rows hit L1): in the weight's layout, with no exchange through
        # shared memory and no barrier, which would keep the unrolled iterations' loads apart.
        x_ptr = x + tl.broadcast_to(rk[None, :], (BLOCK_N, BLOCK_K))
        if EVEN_K:
            wt = tl.load(base + k0)
            xk = tl.load(x_ptr)
        else:
            wt = tl.load(base + k0, mask=(rk < hi)[None, :], other=0.0)
            xk = tl.load(x_ptr, mask=(rk < hi)[None, :], other=0.0)
        # Each thread holds VEC consecutive values (one 16-byte load): summed there, the tile that is
        # carried across iterations is a VEC-th of the loaded one.
        product = wt.to(tl.float32) * xk.to(tl.float32)
        acc += tl.sum(tl.reshape(product, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)
    result = tl.sum(acc, axis=1)
    if HAS_SCALE:
        result *= tl.load(w_scale + rn_ld)
    rm = tl.arange(0, 1)
    _store(out, result[None, :], rm, rn, rm < 1, n_ok, 0, SPLIT_K)


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
    PDL: tl.constexpr,
):
    """2-16 rows of x: the e4m3 tile goes to x's dtype and through tl.dot; the row scale at the end."""
    pdl.start(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    lo, hi = _span(K, pid_k, SPLIT_K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < hi
        wt = tl.load(w + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xk = tl.load(x + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xk, tl.trans(wt.to(xk.dtype)), acc, input_precision=PRECISION)
    s = tl.load(w_scale + rn, mask=n_ok, other=0.0)
    _store(out, acc * s[None, :], rm, rn, m_ok, n_ok, stride_om, SPLIT_K)


def default_config(m: int, n: int, k: int, bits: int, device: torch.device) -> SkinnyConfig:
    """Tiles for m rows of a [n, k] weight, from the H200 sweeps of benchmarks/gpu/bench_quant_gemm.py
    (Llama-3.1-8B's linears, docs/performance.md): at one row, small programs reading wide rows along K,
    the loop unrolled; K split only where the grid would otherwise leave SMs without a program."""
    if m == 1:
        if bits == 4:
            if n >= 16384:
                config = SkinnyConfig(16, 1024, 1, num_warps=4, num_stages=1, unroll=2)
            else:
                config = SkinnyConfig(8 if n <= 4096 else 16, 2048, 1, num_warps=4, num_stages=1, unroll=2)
        elif bits == 16:  # the sweep of 2026-12-03: LM head, gate+up, down, O, QKV of the 8B shape
            if n >= 65536:
                config = SkinnyConfig(8, 512, 1, num_warps=4, num_stages=1)
            elif n >= 16384:
                config = SkinnyConfig(8, 512, 1, num_warps=4, num_stages=1, unroll=4)
            elif k >= 8192:
                config = SkinnyConfig(16, 1024, 1, num_warps=8, num_stages=1, unroll=2)
            elif n <= 4096:
                config = SkinnyConfig(16, 1024, 1, num_warps=8, num_stages=1, unroll=4)
            else:
                config = SkinnyConfig(8, 1024, 1, num_warps=8, num_stages=1)
        elif n >= 16384:
            config = SkinnyConfig(16, 256, 1, num_warps=4, num_stages=1)
        elif k >= 8192:
            config = SkinnyConfig(16, 2048, 1, num_warps=8, num_stages=1, unroll=2)
        else:
            config = SkinnyConfig(16, 1024, 1, num_warps=8, num_stages=1, unroll=4)
        tiles = triton.cdiv(n, config.block_n)
        if tiles >= sm_count(device):
            return config
    elif bits == 4:
        config = SkinnyConfig(32, 512, 1, num_warps=4, num_stages=3)
    else:
        config = SkinnyConfig(32, 256, 1, num_warps=4, num_stages=3)
    tiles = triton.cdiv(n, config.block_n)
    return config._replace(split_k=k_splits(tiles, k, config.block_k, device, limit=8))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] with unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor, m: int, n: int, config: SkinnyConfig, launch, bias: torch.Tensor | None
) -> torch.Tensor:
    """Calls launch(out, grid) over the [n] outputs of m rows in config's tiles (out fp32 and zeroed when
    K is split); returns [..., n] in x's dtype, bias added."""
    if config.split_k > 1:
        out = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        launch(out, (triton.cdiv(n, config.block_n), config.split_k))
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def _even(units: int, block: int, config: SkinnyConfig) -> bool:
    """Whether every split of `units` along K is whole blocks: the one-row kernels then mask no load."""
    return units % (block * config.split_k) == 0


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
    block_w = config.block_k // 8
    if m > 1 and block_w < 16:
        raise ValueError("w4a16_skinny: more than one row takes block_k >= 128 (tl.dot needs 16 words)")
    zero_arg = zero if zero is not None else scale
    z_stride = zero.stride(0) if zero is not None else 0

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        common = dict(
            GROUP=group_size, HAS_ZERO=zero is not None, BLOCK_N=config.block_n, BLOCK_W=block_w,
            SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        if m == 1:
            # The scale is looked up once per SUB words: at most 4, and never across a group's end.
            sub = math.gcd(4, group_size // 8, block_w)
            even = k % 8 == 0 and _even(k // 8, block_w, config)
            _w4a16_gemv_kernel[grid](
                x2, w_packed, scale, zero_arg, out, n, k, w_packed.stride(0), scale.stride(0), z_stride,
                MAGIC, SUB=sub, EVEN_K=even, UNROLL=config.unroll, **common,
                **_gemv4_pdl(x2),
            )  # fmt: skip
        else:
            _w4a16_skinny_kernel[grid](
                x2, w_packed, scale, zero_arg, out, m, n, k, x2.stride(0), w_packed.stride(0),
                scale.stride(0), z_stride, out.stride(0), MAGIC,
                BLOCK_M=MAX_ROWS, PRECISION=_precision(x), **common, **pdl.launch_args(x2),
            )  # fmt: skip

    return _launch(x, m, n, config, launch, bias)


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
    w_scale = w_scale.reshape(-1)
    if w_scale.dtype != torch.float32:
        w_scale = w_scale.float()

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        common = dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
                      num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip
        if m == 1:
            _w8a16_gemv_kernel[grid](
                x2, w_q, w_scale, out, n, k, w_q.stride(0),
                EVEN_K=_even(k, config.block_k, config), UNROLL=config.unroll, HAS_SCALE=True, VEC=16,
                **common, **pdl.launch_args(x2),
            )  # fmt: skip
        else:
            _w8a16_skinny_kernel[grid](
                x2, w_q, w_scale, out, m, n, k, x2.stride(0), w_q.stride(0), out.stride(0),
                BLOCK_M=MAX_ROWS, PRECISION=_precision(x), **common, **pdl.launch_args(x2),
            )  # fmt: skip

    return _launch(x, m, n, config, launch, bias)


def dense_gemv(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """One row x [..., K] @ w^T for a dense 16-bit weight [N, K]: the FP8 one-row kernel without its scale.
    At batch-1 decode of the 8B shape it reads the weights faster than cuBLAS's GEMV (H200: the whole
    step 4.27 against 4.59 ms, docs/performance.md), and launches with PDL as cuBLAS cannot."""
    x2 = _rows(x)
    m, k = x2.shape
    n = w.shape[0]
    if m != 1 or w.stride(1) != 1:
        raise ValueError("dense_gemv takes one row and a weight contiguous along K")
    config = config or default_config(1, n, k, 16, x.device)

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        _w8a16_gemv_kernel[grid](
            x2, w, w, out, n, k, w.stride(0), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            SPLIT_K=config.split_k, EVEN_K=_even(k, config.block_k, config), UNROLL=config.unroll,
            HAS_SCALE=False, VEC=8, num_warps=config.num_warps, num_stages=config.num_stages,
            **pdl.launch_args(x2),
        )  # fmt: skip

    return _launch(x, m, n, config, launch, bias)


# Whether the one-row 4-bit kernel launches with PDL: off, since with it the INT4 8B step ran 1-6%
# slower (H200, bench_pdl.py, two calls), unlike bf16 and FP8.
GEMV4_PDL = False


def _gemv4_pdl(x: torch.Tensor) -> dict:
    return pdl.launch_args(x) if GEMV4_PDL else {"PDL": False, "launch_pdl": False}


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"
