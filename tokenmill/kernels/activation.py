"""Triton SiLU-and-multiply for the gated MLP; with a RowQuant (silu_and_mul_quant) each output row is
also quantized in the launch for the FP8 or INT8 linear after it (the bits of the separate quantizing
launch, kernels/fp8_quant.py, one launch fewer). x may be the gate/up projection's product with its
scales not yet applied (ScaledRows): the launch applies them as it loads gate and up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import QuantizedRows, RowQuant, ScaledRows, pdl
from tokenmill.kernels.fp8_quant import (
    TL_DTYPES,
    quantize_groups,
    quantize_values,
    row_scale,
    scaled_rows_args,
)
from tokenmill.kernels.reference import FP8_DTYPE

_BLOCK = 1024
# A quantizing launch's row: in one block of registers up to this many columns (16 warps at 8,192 and up),
# in two passes over blocks of it past that (the products recomputed for the second).
_QUANT_BLOCK = 16384


@triton.jit
def _silu_and_mul_kernel(
    x,
    out,
    stride_x,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
    x_row_scale=None,
    x_col_scale=None,
    SCALED: tl.constexpr = None,
):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row_s = 1.0
    if SCALED is not None:
        row_s = tl.load(x_row_scale + row)
    product = _silu_product(
        x + row * stride_x, cols, INTERMEDIATE, out.dtype.element_ty, row_s, x_col_scale, SCALED
    )
    tl.store(out + row * stride_out + cols, product.to(out.dtype.element_ty), mask=cols < INTERMEDIATE)


@triton.jit
def _silu_product(
    x,
    cols,
    INTERMEDIATE: tl.constexpr,
    ROUND: tl.constexpr,
    row_s=1.0,
    x_col_scale=None,
    SCALED: tl.constexpr = None,
):
    """silu(gate) * up of a row's columns `cols` (zero past the row's end), rounded to ROUND (the output's
    dtype) and held in fp32. silu(gate) is rounded to the input dtype before the product, as torch's two
    ops round. SCALED (the dtype x stands for): x is an unscaled product, each value multiplied by the
    row's row_s and its column's x_col_scale and rounded to SCALED first, as the linear's output."""
    mask = cols < INTERMEDIATE
    gate = tl.load(x + cols, mask=mask, other=0.0)
    up = tl.load(x + INTERMEDIATE + cols, mask=mask, other=0.0)
    if SCALED is not None:
        gate_s = tl.load(x_col_scale + cols, mask=mask, other=0.0)
        up_s = tl.load(x_col_scale + INTERMEDIATE + cols, mask=mask, other=0.0)
        gate = (gate.to(tl.float32) * row_s * gate_s).to(SCALED)
        up = (up.to(tl.float32) * row_s * up_s).to(SCALED)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return (silu.to(tl.float32) * up.to(tl.float32)).to(ROUND).to(tl.float32)


@triton.jit
def _silu_and_mul_quant_kernel(
    x,
    out,
    scale_out,
    static_scale,
    stride_x,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,
    INT8: tl.constexpr,
    STATIC: tl.constexpr,
    PDL: tl.constexpr,
    GROUP: tl.constexpr = 0,
    x_row_scale=None,
    x_col_scale=None,
    SCALED: tl.constexpr = None,
):
    """One program a row: the row's products (zero past its end: they leave the amax alone), its scale
    (fp8_quant.row_scale's rule), the products quantized at it into `out` and the scale at scale_out.
    GROUP: each GROUP columns at their own scale (e4m3; BLOCK a multiple of GROUP), one pass. SCALED:
    x is an unscaled product (_silu_product)."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    row_s = 1.0
    if SCALED is not None:
        row_s = tl.load(x_row_scale + row)
    x_row = x + row * stride_x
    out_row = out + row * stride_out
    cols = tl.arange(0, BLOCK)
    if GROUP:
        num_groups: tl.constexpr = (INTERMEDIATE + GROUP - 1) // GROUP
        groups = tl.arange(0, BLOCK // GROUP)
        for start in range(0, INTERMEDIATE, BLOCK):
            v = _silu_product(x_row, start + cols, INTERMEDIATE, ROUND, row_s, x_col_scale, SCALED)
            q, scales = quantize_groups(v, BLOCK // GROUP, GROUP)
            tl.store(out_row + start + cols, q.to(out.dtype.element_ty), mask=start + cols < INTERMEDIATE)
            first = start // GROUP
            tl.store(scale_out + row * num_groups + first + groups, scales, mask=first + groups < num_groups)
    elif BLOCK >= INTERMEDIATE:  # the row in registers
        v = _silu_product(x_row, cols, INTERMEDIATE, ROUND, row_s, x_col_scale, SCALED)
        scale = row_scale(tl.abs(v), static_scale, INT8, STATIC)
        q = quantize_values(v, scale, INT8)
        tl.store(out_row + cols, q.to(out.dtype.element_ty), mask=cols < INTERMEDIATE)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        if not STATIC:
            for start in range(0, INTERMEDIATE, BLOCK):
                amax = tl.maximum(
                    amax,
                    tl.abs(
                        _silu_product(x_row, start + cols, INTERMEDIATE, ROUND, row_s, x_col_scale, SCALED)
                    ),
                )
        scale = row_scale(amax, static_scale, INT8, STATIC)
        for start in range(0, INTERMEDIATE, BLOCK):
            q = quantize_values(
                _silu_product(x_row, start + cols, INTERMEDIATE, ROUND, row_s, x_col_scale, SCALED),
                scale,
                INT8,
            )
            tl.store(out_row + start + cols, q.to(out.dtype.element_ty), mask=start + cols < INTERMEDIATE)
    if not GROUP:
        tl.store(scale_out + row, scale)


def silu_and_mul_quant(x: torch.Tensor | ScaledRows, quant: RowQuant) -> QuantizedRows:
    """silu_and_mul(x), each row quantized in the same launch as `quant` asks."""
    x, x_dtype, scaled_args = scaled_rows_args(x)
    intermediate = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * intermediate)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    dtype = torch.int8 if quant.int8 else FP8_DTYPE
    out = torch.empty(rows.shape[0], intermediate, dtype=dtype, device=x.device)
    scales = 1 if quant.group is None else triton.cdiv(intermediate, quant.group)
    scale = torch.empty(rows.shape[0], scales, dtype=torch.float32, device=x.device)
    if rows.shape[0] > 0:
        block = min(_QUANT_BLOCK, triton.next_power_of_2(intermediate))
        if quant.group is not None:
            block = max(block, quant.group)  # whole groups
        _silu_and_mul_quant_kernel[(rows.shape[0],)](
            rows, out, scale, quant.static_scale if quant.static_scale is not None else scale,
            rows.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=block,
            ROUND=TL_DTYPES[x_dtype], INT8=quant.int8, STATIC=quant.static_scale is not None,
            GROUP=quant.group or 0, num_warps=16 if block >= 8192 else 8 if block >= 4096 else 4,
            **scaled_args, **pdl.launch_args(x),
        )  # fmt: skip
    return QuantizedRows(out, scale, torch.Size((*x.shape[:-1], intermediate)), x_dtype)


def silu_and_mul(x: torch.Tensor | ScaledRows) -> torch.Tensor:
    """x [..., 2I] = gate || up  ->  silu(gate) * up, [..., I]."""
    x, x_dtype, scaled_args = scaled_rows_args(x)
    intermediate = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * intermediate)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], intermediate, dtype=x_dtype, device=x.device)
    if rows.shape[0] > 0:
        grid = (rows.shape[0], triton.cdiv(intermediate, _BLOCK))
        _silu_and_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=_BLOCK, num_warps=4,
            **scaled_args, **pdl.launch_args(x),
        )  # fmt: skip
    return out.view(*x.shape[:-1], intermediate)
