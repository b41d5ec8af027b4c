"""Triton GEMMs for a few rows of activations against a quantized weight: decode's shape, where the
step reads every weight once and the matmul is a matrix-vector product in all but name.

- w4a16_skinny: 4-bit weights in the pack-quantized layout of kernels/int4_gemm.py (int32 [N, K/8],
  each value stored as q + 8, group scales [N, K/group], optional int8 zero points).
- w8a16_skinny: e4m3 weights [N, K] with one fp32 scale per output row (online FP8 and per-channel or
  per-tensor checkpoints); activations stay in their own dtype: no quantization launch, no cuBLAS
  FP8 GEMM tuned for large tiles.

Both read the weight in wide rows (coalesced) and dequantize in registers: with 2-16 rows through
tl.dot (kernels/skinny_dot.py), with one row in the kernels of kernels/gemv.py (which also serve dense
16-bit weights, `dense_gemv`).

The references are kernels/quant_reference.py's w4a16_gemm and w8a16_gemm (the launch hint aside,
the same signatures).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch
import triton

from tokenmill.kernels import SKINNY_MAX_ROWS as MAX_ROWS
from tokenmill.kernels import (
    GemvFusion,
    gemv,
    gemv_f16x2,
    k_splits,
    pdl,
    skinny_dot,
    sm_count,
)
from tokenmill.kernels.interpreter import INTERPRETED


class SkinnyConfig(NamedTuple):
    block_n: int
    block_k: int  # values along K per iteration (4-bit: eight to a word)
    split_k: int
    num_warps: int
    num_stages: int
    unroll: int = 1  # one row: K-loop iterations unrolled, so that their loads are in flight together
    prefetch: bool = False  # one row, 4-bit, 16-bit x: each step's loads issued a step ahead (registers)
    block_m: int = 0  # w8a16_grouped: rows a program (0: by the rows, 16, 32 or 64)
    swap_ab: bool = False  # w8a16_grouped: the weight's tile the dot's first operand (wgmma's from registers)


def default_config(m: int, n: int, k: int, bits: int, device: torch.device) -> SkinnyConfig:
    """Tiles for m rows of a [n, k] weight, from the H200 sweeps of benchmarks/gpu/bench_quant_gemm.py
    (Llama-3.1-8B's linears, docs/performance.md): at one row, small programs reading wide rows along K,
    the loop unrolled; K split only where the grid would otherwise leave SMs without a program."""
    if m == 1:
        if bits == 4:  # the packed-fp16 kernel's sweep of 2026-12-03 (gate+up, down, O, QKV)
            if n >= 16384:
                config = SkinnyConfig(16, 1024, 1, num_warps=4, num_stages=1)
            elif k >= 8192:
                config = SkinnyConfig(16, 2048, 1, num_warps=8, num_stages=1, prefetch=True)
            elif n <= 4096:
                config = SkinnyConfig(8, 2048, 1, num_warps=4, num_stages=1, unroll=2)
            else:
                config = SkinnyConfig(16, 2048, 1, num_warps=8, num_stages=1, unroll=2)
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
        elif n >= 16384:  # FP8 (W8A16): 8-row programs here and below won the sweep of 2026-12-03
            config = SkinnyConfig(8, 512, 1, num_warps=2, num_stages=1, unroll=2)
        elif k >= 8192 or n <= 4096:
            config = SkinnyConfig(8, 2048, 1, num_warps=8, num_stages=1)
        else:  # QKV's tile: the same sweep found nothing better
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


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [rows, K] with unit stride along K."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def launch_over_rows(
    x: torch.Tensor,
    m: int,
    n: int,
    config: SkinnyConfig,
    launch,
    bias: torch.Tensor | None,
    fused: gemv.Fused | None = None,
) -> torch.Tensor:
    """Calls launch(out, grid) over the [n] outputs of m rows in config's tiles (out fp32 and zeroed when
    K is split); returns [..., n] in x's dtype, bias added; then what `fused` leaves to be done after the
    launch. With the gated store (gemv.fused_args) the outputs are n / 2, half a tile a program."""
    gated = fused is not None and fused.gated
    columns, per_program = (n // 2, config.block_n // 2) if gated else (n, config.block_n)
    if config.split_k > 1:
        out = torch.zeros(m, columns, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(m, columns, dtype=x.dtype, device=x.device)
    if m:
        launch(out, (triton.cdiv(columns, per_program), config.split_k))
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    if fused is not None and fused.act_after:
        from tokenmill.kernels import activation

        out = activation.silu_and_mul(out)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _even(units: int, block: int, config: SkinnyConfig) -> bool:
    """Whether every split of `units` along K is whole blocks: the one-row kernels then mask no load."""
    return units % (block * config.split_k) == 0


def early_tiles(k: int, itemsize: int, config: SkinnyConfig) -> int:
    """The weight tiles the 8- and 16-bit one-row kernel loads before its PDL wait (its EARLY): GEMV_EARLY,
    at most the tiles of a split and the tiles EARLY_BYTES a thread hold; none where a split's steps
    are not whole tiles (their loads are masked)."""
    if not GEMV_EARLY or not _even(k, config.block_k, config):
        return 0
    tile_bytes = config.block_n * config.block_k * itemsize // (32 * config.num_warps)
    held = max(1, EARLY_BYTES // max(1, tile_bytes))
    return min(int(GEMV_EARLY), k // (config.block_k * config.split_k), held)


def packed_kernel_takes(dtype: torch.dtype, rows: int) -> bool:
    """Whether `rows` rows of activations in `dtype` go to the packed-fp16 4-bit kernel."""
    return GEMV4_F16X2 and dtype in (torch.bfloat16, torch.float16) and 1 <= rows <= _gemv_rows(GEMV4_ROWS)


def w4a16_skinny(
    x: torch.Tensor,
    w_packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    fusion: GemvFusion | None = None,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ W^T -> [..., N] in x's dtype; group_size a multiple of 8.
    One row, and 16-bit activations of up to GEMV4_ROWS rows, take the one-row kernels (the packed-fp16
    one for 16-bit x, its programs reading each weight word once for every row). `fusion` (the
    packed-fp16 kernel's rows only, packed_kernel_takes): GemvFusion's work done in the launch."""
    x2 = as_rows(x)
    m, k = x2.shape
    n = w_packed.shape[0]
    if m > MAX_ROWS or group_size % 8:
        raise ValueError(f"w4a16_skinny takes at most {MAX_ROWS} rows and groups of a multiple of 8")
    packed_rows = packed_kernel_takes(x2.dtype, m)
    if fusion is not None and not packed_rows:
        raise ValueError("w4a16_skinny takes a GemvFusion only where the packed-fp16 kernel runs")
    config = config or default_config(1 if packed_rows else m, n, k, 4, x.device)
    block_w = config.block_k // 8
    if m > 1 and not packed_rows and block_w < 16:
        raise ValueError("w4a16_skinny: more than one row takes block_k >= 128 (tl.dot needs 16 words)")
    zero_arg = zero if zero is not None else scale
    z_stride = zero.stride(0) if zero is not None else 0
    fused = gemv.fused_args(fusion, n, config.split_k, bias)

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        common = dict(
            GROUP=group_size, HAS_ZERO=zero is not None, BLOCK_N=config.block_n, BLOCK_W=block_w,
            SPLIT_K=config.split_k, num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        if m == 1 or packed_rows:
            # The scale is looked up once per SUB words: at most 4, and never across a group's end.
            sub = math.gcd(4, group_size // 8, block_w)
            even = k % 8 == 0 and _even(k // 8, block_w, config)
            if packed_rows:
                gemv_f16x2.w4a16_gemv_f16x2_kernel[grid](
                    x2, w_packed, scale, zero_arg, out, N=n, K=k, stride_xm=x2.stride(0),
                    stride_wn=w_packed.stride(0), stride_sn=scale.stride(0), stride_zn=z_stride,
                    stride_om=out.stride(0), ROWS=m, SUB=sub, EVEN_K=even, UNROLL=config.unroll,
                    ASM=not INTERPRETED, PREFETCH=config.prefetch and even,
                    EARLY=bool(GEMV_EARLY) and config.prefetch and even, GATED=fused.gated,
                    PAIRED=GEMV4_PAIRED and sub % 2 == 0, WIDE_X=GEMV4_WIDE_X and even, **common,
                    **pdl.launch_args(x2, GEMV4_PDL),
                )  # fmt: skip
                return
            gemv.w4a16_gemv_kernel[grid](
                x2, w_packed, scale, zero_arg, out, n, k, w_packed.stride(0), scale.stride(0), z_stride,
                gemv.MAGIC, SUB=sub, EVEN_K=even, UNROLL=config.unroll, **common,
                **pdl.launch_args(x2, GEMV4_PDL),
            )  # fmt: skip
        else:
            skinny_dot.w4a16_dot_kernel[grid](
                x2, w_packed, scale, zero_arg, out, m, n, k, x2.stride(0), w_packed.stride(0),
                scale.stride(0), z_stride, out.stride(0), gemv.MAGIC,
                BLOCK_M=MAX_ROWS, PRECISION=dot_precision(x), **common, **pdl.launch_args(x2),
            )  # fmt: skip

    return launch_over_rows(x, m, n, config, launch, bias, fused)


def w8a16_skinny(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    fusion: GemvFusion | None = None,
) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ (w_q * w_scale)^T -> [..., N] in x's dtype: w_q e4m3 [N, K],
    w_scale fp32 with one value per row ([N] or [N, 1]). `fusion` (the one-row kernel's rows only,
    w8a16_gemv_takes): GemvFusion's work done in the launch."""
    x2 = as_rows(x)
    m = x2.shape[0]
    n, k = w_q.shape
    if m > MAX_ROWS:
        raise ValueError(f"w8a16_skinny takes at most {MAX_ROWS} rows")
    one_row_kernel = w8a16_gemv_takes(m)
    if fusion is not None and not one_row_kernel:
        raise ValueError("w8a16_skinny takes a GemvFusion only where the one-row kernel runs")
    config = config or default_config(1 if one_row_kernel else m, n, k, 8, x.device)
    if not one_row_kernel and config.block_k < 16:
        raise ValueError("w8a16_skinny: more than one row takes block_k >= 16 (tl.dot's least K)")
    w_scale = w_scale.reshape(-1)
    if w_scale.dtype != torch.float32:
        w_scale = w_scale.float()
    fused = gemv.fused_args(fusion, n, config.split_k, bias)

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        common = dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=config.split_k,
                      num_warps=config.num_warps, num_stages=config.num_stages)  # fmt: skip
        if one_row_kernel:
            even = _even(k, config.block_k, config)
            gemv.w8a16_gemv_kernel[grid](
                x2, w_q, w_scale, out, N=n, K=k, stride_xm=x2.stride(0), stride_wn=w_q.stride(0),
                stride_om=out.stride(0), ROWS=m,
                EVEN_K=even, UNROLL=config.unroll, HAS_SCALE=True, VEC=16, EARLY=early_tiles(k, 1, config),
                GATED=fused.gated, **common, **pdl.launch_args(x2),
            )  # fmt: skip
        else:
            skinny_dot.w8a16_dot_kernel[grid](
                x2, w_q, w_scale, out, m, n, k, x2.stride(0), w_q.stride(0), out.stride(0),
                BLOCK_M=MAX_ROWS, PRECISION=dot_precision(x), **common, **pdl.launch_args(x2),
            )  # fmt: skip

    return launch_over_rows(x, m, n, config, launch, bias, fused)


def w8a16_gemv_takes(rows: int) -> bool:
    """Whether w8a16_skinny runs `rows` rows through the one-row kernel: one, or up to GEMV8_ROWS."""
    return 1 <= rows <= _gemv_rows(GEMV8_ROWS)


def dense_gemv_takes(rows: int) -> bool:
    """Whether dense_gemv takes `rows` rows: one, or up to DENSE_ROWS (at most MAX_GEMV_ROWS)."""
    return 1 <= rows <= _gemv_rows(DENSE_ROWS)


def dense_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    fusion: GemvFusion | None = None,
) -> torch.Tensor:
    """One row x [..., K] @ w^T (or up to DENSE_ROWS rows) for a dense 16-bit weight [N, K]: the FP8
    one-row kernel without its scale. At batch-1 decode of the 8B shape it reads the weights faster than
    cuBLAS's GEMV (H200: the whole step 4.27 against 4.59 ms, docs/performance.md), and launches with
    PDL as cuBLAS cannot. `fusion`: GemvFusion's work done in the launch."""
    x2 = as_rows(x)
    m = x2.shape[0]
    n, k = w.shape
    if not dense_gemv_takes(m) or w.stride(1) != 1:
        raise ValueError("dense_gemv takes one row (DENSE_ROWS at most) and a weight contiguous along K")
    config = config or default_config(1, n, k, 16, x.device)
    fused = gemv.fused_args(fusion, n, config.split_k, bias)

    def launch(out: torch.Tensor, grid: tuple[int, int]) -> None:
        even = _even(k, config.block_k, config)
        gemv.w8a16_gemv_kernel[grid](
            x2, w, w, out, N=n, K=k, stride_xm=x2.stride(0), stride_wn=w.stride(0), stride_om=out.stride(0),
            ROWS=m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            SPLIT_K=config.split_k, EVEN_K=even, UNROLL=config.unroll,
            HAS_SCALE=False, VEC=8, EARLY=early_tiles(k, 2, config), num_warps=config.num_warps,
            num_stages=config.num_stages, GATED=fused.gated, **pdl.launch_args(x2),
        )  # fmt: skip

    return launch_over_rows(x, m, n, config, launch, bias, fused)


# Whether the one-row 4-bit kernels launch with PDL: on since the packed-fp16 kernel (INT4 8B step 2.400
# against 2.541 ms without, H200, bench_pdl.py, 2026-12-03); the fp32 kernel had run 1-6% slower with it.
GEMV4_PDL = True
# Whether one row of 16-bit activations takes the packed-fp16 4-bit kernel (kernels/gemv_f16x2.py) rather
# than the fp32 one; fp32 activations always take the fp32 kernel.
GEMV4_F16X2 = True
# Up to how many rows of 16-bit activations the packed-fp16 kernel takes (int4_gemm.w4a16_linear sends
# them here; each weight word unpacked once for every row). H200, 8B shapes, 2026-12-03 (twenty-third
# session): at 2 rows 7.8-34.7 us against kernels/w4a16_mma.py's 11.7-47.0 (every shape faster); at 3
# rows tied or slower (down 31.4 against 26.0), at 4 slower (gate+up 63.6 against 47.0).
GEMV4_ROWS = 2
# The same for the FP8 (W8A16) one-row kernel (gemv.w8a16_gemv_kernel's ROWS, each weight tile converted
# once for every row) against the tl.dot kernel (skinny_dot.py): faster at 2 rows (gate+up 34.1 against
# 44.1 us) and 3 (40.9 against 43.7, QKV tied), mixed at 4. The dense one against cuBLAS: 0.7% faster at
# 2 rows summed over a layer (gate+up slower), slower at 3-4: stays off.
GEMV8_ROWS = 3
DENSE_ROWS = 1
MAX_GEMV_ROWS = 4  # the most these candidates take (each row's accumulators cost registers)
# Whether the packed-fp16 4-bit kernel sums two adjacent words' products in fp16 before converting to fp32
# (gemv_f16x2's PAIRED): its loop at gate+up's tile 417 -> 384 sm_90 instructions (sass_loop.py). Whether
# it loads each word's eight activations as one 16-byte vector (WIDE_X, whole steps along K only): 373
# with both. Batch-1 Llama-3.1-8B INT4 step on an H200 (bench_pdl, 2026-12-04): 2.191 ms without either,
# 2.151 with PAIRED, 2.125 with WIDE_X, 2.041 with both (-6.8%). On; off for A/B.
GEMV4_PAIRED = True
GEMV4_WIDE_X = True


def _gemv_rows(switch: int) -> int:
    """The rows a one-row kernel takes for a GEMV*_ROWS / DENSE_ROWS switch: 1 to MAX_GEMV_ROWS."""
    return max(1, min(switch, MAX_GEMV_ROWS))


@contextlib.contextmanager
def switches(**values: object) -> Iterator[None]:
    """This module's switches above (GEMV4_PDL, GEMV4_F16X2, GEMV_EARLY, GEMV4_ROWS, ...) set to `values`
    inside and restored after: for benchmarks that time the candidates side by side."""
    unknown = sorted(name for name in values if not name.isupper() or name not in globals())
    if unknown:
        raise ValueError(f"skinny_gemm has no switch named {', '.join(unknown)}")
    saved = {name: globals()[name] for name in values}
    globals().update(values)
    try:
        yield
    finally:
        globals().update(saved)


# How many weight tiles the one-row kernels load before the PDL wait, while the kernel before still runs
# (the 4-bit one: its first, where its config loads a step ahead; 0: none). One: the 8B batch-1 step's
# graph (bench_pdl.py, H200, 2026-12-03) bf16 4.141 -> 4.029 ms, FP8 2.611 -> 2.532, INT4 2.190 -> 2.174.
# (A GEMV that asked L2 for 4-16 KB of every weight row there, far more bytes, had made the step slower:
# eighteenth session, docs/performance.md.) More (TOKENMILL_GEMV_EARLY): a short GEMV's whole weight
# (the 8B's O and QKV in FP8) requested while the attention or the norm before it runs; 2 and 4 tiles made
# the FP8 step 4.9% and 7.1% slower on an H100 (more registers: the O GEMV's programs in two waves), bf16
# 0.7% faster (forty-ninth session).
GEMV_EARLY = int(os.environ.get("TOKENMILL_GEMV_EARLY", "1"))
# The most weight bytes a thread holds over the wait for those early tiles (registers: 4 bytes each).
EARLY_BYTES = 256


def dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"
