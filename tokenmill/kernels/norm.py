"""Triton RMSNorm, alone and fused with the residual add; rounds exactly where the reference does. With a
RowQuant (rms_norm_quant) the launch also quantizes each normalized row for the FP8 or INT8 linear after
it, writing the quantized rows and their scales in place of the 16-bit output: the bits the separate
quantizing launch (kernels/fp8_quant.py) would write, one launch fewer. x may be a W8A8 linear's product
with its scales not yet applied (ScaledRows): the launch applies them as it loads each row."""

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


@triton.jit
def _rms_norm_kernel(
    x,
    residual,
    weight,
    out,
    residual_out,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr = False,
    scale_out=None,
    static_scale=None,
    QUANT: tl.constexpr = None,
    INT8: tl.constexpr = False,
    STATIC: tl.constexpr = False,
    GROUP: tl.constexpr = 0,
    x_row_scale=None,
    x_col_scale=None,
    SCALED: tl.constexpr = None,
):
    """One program per row: optional residual add (rounded to the residual's dtype, as torch does),
    then normalise in fp32, round to the input dtype, and multiply by the weight. EARLY
    (pdl.EARLY_READS): the weight is read before the PDL wait (no kernel of the step writes it).
    QUANT (the output's 16-bit dtype): the product, rounded to it, is quantized to `out`'s int8 or e4m3
    at the row's scale (fp8_quant.row_scale's rule, STATIC: the static one), stored at scale_out; with
    GROUP, each GROUP columns at their own scale (e4m3), a row's ceil(HIDDEN / GROUP) scales at scale_out.
    SCALED (the dtype x stands for; ScaledRows): x is an unscaled product, each value multiplied by its
    row's x_row_scale and its column's x_col_scale in fp32 and rounded to SCALED, as the linear's output
    (x_col_scale, the weight's, read before the PDL wait with the norm's weight under EARLY)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    if EARLY:
        w = tl.load(weight + cols, mask=mask, other=0.0)
        if SCALED is not None:
            col_s = tl.load(x_col_scale + cols, mask=mask, other=0.0)
    pdl.start(PDL)
    hidden = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    if SCALED is not None:
        if not EARLY:
            col_s = tl.load(x_col_scale + cols, mask=mask, other=0.0)
        hidden = (hidden.to(tl.float32) * tl.load(x_row_scale + row) * col_s).to(SCALED)
    if ADD_RESIDUAL:
        res = tl.load(residual + row * stride_residual + cols, mask=mask, other=0.0)
        hidden = (hidden.to(tl.float32) + res.to(tl.float32)).to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * stride_residual_out + cols, hidden, mask=mask)
    hidden32 = hidden.to(tl.float32)
    mean_square = tl.sum(hidden32 * hidden32, 0) / HIDDEN
    normed = (hidden32 * tl.rsqrt(mean_square + eps)).to(hidden.dtype)
    if not EARLY:
        w = tl.load(weight + cols, mask=mask, other=0.0)
    result = normed.to(tl.float32) * w.to(tl.float32)
    if QUANT is not None and GROUP:
        rounded = result.to(QUANT).to(tl.float32)  # masked columns are 0, as the padding of a ragged group
        q, scales = quantize_groups(rounded, BLOCK // GROUP, GROUP)
        tl.store(out + row * stride_out + cols, q.to(out.dtype.element_ty), mask=mask)
        groups = tl.arange(0, BLOCK // GROUP)
        num_groups: tl.constexpr = (HIDDEN + GROUP - 1) // GROUP
        tl.store(scale_out + row * num_groups + groups, scales, mask=groups < num_groups)
    elif QUANT is not None:
        rounded = result.to(QUANT).to(tl.float32)  # masked columns are 0: they leave the amax alone
        scale = row_scale(tl.abs(rounded), static_scale, INT8, STATIC)
        q = quantize_values(rounded, scale, INT8)
        tl.store(out + row * stride_out + cols, q.to(out.dtype.element_ty), mask=mask)
        tl.store(scale_out + row, scale)
    else:
        tl.store(out + row * stride_out + cols, result.to(out.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor | ScaledRows,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quant: RowQuant | None = None,
) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor | None]:
    x, x_dtype, scaled_args = scaled_rows_args(x)
    hidden_size = x.shape[-1]
    rows = x.reshape(-1, hidden_size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    residual_rows = residual_out = None
    normed_dtype = x_dtype
    if residual is not None:
        residual_rows = residual.reshape(-1, hidden_size).contiguous()
        normed_dtype = torch.promote_types(x_dtype, residual.dtype)
        residual_out = torch.empty(rows.shape, dtype=normed_dtype, device=x.device)
    out_dtype = torch.promote_types(weight.dtype, normed_dtype)
    quant_args: dict = {}
    if quant is not None:
        out = torch.empty(rows.shape, dtype=torch.int8 if quant.int8 else FP8_DTYPE, device=x.device)
        scales = 1 if quant.group is None else triton.cdiv(hidden_size, quant.group)
        scale = torch.empty(rows.shape[0], scales, dtype=torch.float32, device=x.device)
        quant_args = dict(
            scale_out=scale, static_scale=quant.static_scale if quant.static_scale is not None else scale,
            QUANT=TL_DTYPES[out_dtype], INT8=quant.int8, STATIC=quant.static_scale is not None,
            GROUP=quant.group or 0,
        )  # fmt: skip
    else:
        out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden_size)
        if quant is not None and quant.group is not None:
            block = max(block, quant.group)  # whole groups
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows if residual is not None else rows, weight, out,
            residual_out if residual_out is not None else out,
            rows.stride(0), residual_rows.stride(0) if residual_rows is not None else 0,
            out.stride(0), residual_out.stride(0) if residual_out is not None else 0, eps,
            HIDDEN=hidden_size, BLOCK=block, ADD_RESIDUAL=residual is not None,
            EARLY=pdl.EARLY_READS, num_warps=min(max(block // 512, 1), 16), **quant_args, **scaled_args,
            **pdl.launch_args(x),
        )  # fmt: skip
    if residual_out is not None:
        residual_out = residual_out.view(*x.shape[:-1], hidden_size)
    if quant is not None:
        return QuantizedRows(out, scale, x.shape, out_dtype), residual_out
    return out.view(*x.shape[:-1], hidden_size), residual_out


def rms_norm(x: torch.Tensor | ScaledRows, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in fp32 and cast back, as transformers does."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor | ScaledRows, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + x, then RMSNorm of the sum, in one pass; returns (normed, new residual).
    Writes fresh tensors: neither input is modified."""
    out, residual_out = _launch(x, residual, weight, eps)
    return out, residual_out


def rms_norm_quant(
    x: torch.Tensor | ScaledRows,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quant: RowQuant,
) -> tuple[QuantizedRows, torch.Tensor | None]:
    """RMSNorm of x (of residual + x, with a residual) with each normalized row quantized in the same
    launch as `quant` asks: (the quantized rows, the new residual or None)."""
    return _launch(x, residual, weight, eps, quant)
