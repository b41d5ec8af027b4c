"""Triton per-row activation quantization: one program per row (token) finds the row's largest magnitude,
then writes the row scaled so that magnitude lands on the format's top, and the fp32 scale: e4m3 at 448
(FP8 linears), or int8 at 127.5 rounded half to even and clamped to [-128, 127] (compressed-tensors' INT8
W8A8, whose calibration divides by 127.5: layers/quantization/int8.py). One launch instead of the five to
seven elementwise and reduction kernels the torch expression takes, for every W8A8 linear's input, which
at decode batch sizes is all launch overhead. The references are kernels/quant_reference.py's
quantize_fp8_per_row and layers/quantization/int8.py's quantize_int8_reference, of the same signatures."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import ScaledRows

# torch's floating dtypes as Triton's, for constexpr arguments: the dtype a launch that quantizes its own
# output (norm.py's, activation.py's) rounds it to first, as its plain launch would store it; the quantized
# experts' operand dtypes (fused_moe_quant.py).
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def scaled_rows_args(x: torch.Tensor | ScaledRows) -> tuple[torch.Tensor, torch.dtype, dict]:
    """For a launch that reads a linear's output: (the tensor to read, the dtype the output has, the
    launch's x_row_scale / x_col_scale / SCALED arguments). A ScaledRows (a W8A8 product with its scales
    left to this launch) gives its unscaled values, its scales and its dtype; a tensor gives itself."""
    if not isinstance(x, ScaledRows):
        return x, x.dtype, {}
    args = dict(
        x_row_scale=x.row_scale.reshape(-1).contiguous(),
        x_col_scale=x.col_scale.reshape(-1).contiguous(),
        SCALED=TL_DTYPES[x.dtype],
    )
    return x.values, x.dtype, args


@triton.jit
def row_scale(amax, static_scale, INT8: tl.constexpr, STATIC: tl.constexpr):
    """A row's fp32 scale from its elementwise magnitudes' running maximum `amax` (a block of them), or
    the static per-tensor scale: the rule of every per-row quantizing launch (this module's and the
    fused ones of norm.py and activation.py), so that they write the same bits."""
    if STATIC:  # a checkpoint's calibrated per-tensor scale
        scale = tl.load(static_scale).to(tl.float32)
    elif INT8:  # IEEE-rounded divisions (`/` may be approximate): a quotient at a half step must stay there
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), 1e-12), 127.5)
    else:
        scale = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0
    return scale


@triton.jit
def quantize_values(v, scale, INT8: tl.constexpr):
    """fp32 values -> their int8 or e4m3 steps at `scale` (still fp32; the store converts)."""
    if INT8:
        # Round half to even (torch.round's rule): |v / scale| <= 127.5, so v + 0.5 is exact.
        v = tl.math.div_rn(v, scale)
        r = tl.floor(v + 0.5)
        r = tl.where((r - v == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r)
        q = tl.clamp(r, -128.0, 127.0)
    else:
        q = tl.clamp(v / scale, -448.0, 448.0)
    return q


@triton.jit
def quantize_groups(v, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """fp32 values of GROUPS groups of GROUP columns (a block of GROUPS * GROUP) -> (their e4m3 steps,
    still fp32, each group at its own scale; the groups' scales [GROUPS]): the per-row rule of
    row_scale and quantize_values applied to each group, as fp8_block.quantize_per_token_group does."""
    groups = tl.reshape(v, [GROUPS, GROUP])
    scales = tl.maximum(tl.max(tl.abs(groups), 1), 1e-12) / 448.0
    q = tl.clamp(groups / scales[:, None], -448.0, 448.0)
    return tl.reshape(q, [GROUPS * GROUP]), scales


@triton.jit
def _quantize_rows_kernel(
    x,
    out,
    scale,
    static_scale,
    K,
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    INT8: tl.constexpr,
    STATIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    if not STATIC:
        for start in range(0, K, BLOCK):
            v = tl.load(x + row * stride_x + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
    row_scale_ = row_scale(amax, static_scale, INT8, STATIC)
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        v = tl.load(x + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = quantize_values(v, row_scale_, INT8)
        tl.store(out + row * stride_out + start + cols, q.to(out.dtype.element_ty), mask=mask)
    tl.store(scale + row, row_scale_)


def quantize_fp8_per_row(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], fp32 scales [R, 1]) with x ~= q * scale, each row's amax at 448; or,
    given a per-tensor static_scale (one value), every row at that scale (saturating at 448)."""
    return _quantize_per_row(x, torch.float8_e4m3fn, static_scale)


def quantize_int8_per_row(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (int8 [R, C], fp32 scales [R, 1]) with x ~= q * scale, each row's amax at 127.5; or,
    given a per-tensor static_scale (one value), every row at that scale (saturating past 127 steps)."""
    return _quantize_per_row(x, torch.int8, static_scale)


def _quantize_per_row(
    x: torch.Tensor,
    dtype: torch.dtype,
    static_scale: torch.Tensor | None = None,
    tiles: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`tiles`: (BLOCK, num_warps) in place of the defaults, for benchmarks/gpu/bench_quant_gemm.py."""
    rows, columns = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, columns, dtype=dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        # A row in one or two blocks of up to 8,192 columns, 16 warps at that width and 8 at 4,096: 8-27%
        # less time than 4,096 at 4 warps on an H100 at 16 to 8,192 rows of 4,096 and 14,336 columns
        # (bench_quant_gemm.py --quantize, 2026-12-06).
        block = min(8192, triton.next_power_of_2(max(columns, 16)))
        warps = 16 if block >= 8192 else 8 if block >= 4096 else 4 if block >= 1024 else 1
        block, warps = tiles or (block, warps)
        _quantize_rows_kernel[(rows,)](
            x,
            out,
            scale,
            static_scale if static_scale is not None else scale,
            columns,
            x.stride(0),
            out.stride(0),
            BLOCK=block,
            INT8=dtype == torch.int8,
            STATIC=static_scale is not None,
            num_warps=warps,
        )
    return out, scale
