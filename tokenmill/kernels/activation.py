"""Triton SiLU-and-multiply for the gated MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import PackedActivations, gemv_f16x2, pdl
from tokenmill.kernels.gemv_packed_x import empty_packed

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x, out, pairs, down, sums, stride_x, stride_out, stride_pm, stride_dm, INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """silu(gate) is rounded to the input dtype before the product, as torch's two ops round. PACK: the
    result also packed for the 4-bit one-row GEMV after it (gemv_f16x2.pack_row)."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x + row * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    product = (silu.to(tl.float32) * up.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + row * stride_out + cols, product, mask=mask)
    if PACK:
        gemv_f16x2.pack_row(
            tl.where(mask, product.to(tl.float32), 0.0), pairs + row * stride_pm, down + row * stride_dm,
            sums + row * stride_dm, INTERMEDIATE, tl.program_id(1) * BLOCK, BLOCK, ASM,
        )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate || up  ->  silu(gate) * up, [..., I]."""
    return _launch(x, pack=False)[0]


def silu_and_mul_packed(x: torch.Tensor) -> tuple[torch.Tensor, PackedActivations]:
    """silu_and_mul, its output also packed for the 4-bit one-row GEMV of the down projection
    (kernels/gemv_packed_x.py; layers/activation.py's forward_packed asks for it)."""
    out, packed = _launch(x, pack=True)
    assert packed is not None
    return out, packed


def _launch(x: torch.Tensor, pack: bool) -> tuple[torch.Tensor, PackedActivations | None]:
    intermediate = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * intermediate)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], intermediate, dtype=x.dtype, device=x.device)
    packed = empty_packed(rows.shape[0], intermediate, x.dtype, x.device) if pack else None
    if rows.shape[0] > 0:
        grid = (rows.shape[0], triton.cdiv(intermediate, _BLOCK))
        pairs, down, sums = packed[:3] if packed is not None else (out, out, out)
        _silu_and_mul_kernel[grid](
            rows, out, pairs, down, sums, rows.stride(0), out.stride(0), pairs.stride(0), down.stride(0),
            INTERMEDIATE=intermediate, BLOCK=_BLOCK, PACK=pack, ASM=not gemv_f16x2.INTERPRETED,
            num_warps=4, **pdl.launch_args(x),
        )  # fmt: skip
    return out.view(*x.shape[:-1], intermediate), packed
