"""Triton SiLU-and-multiply for the gated MLP."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels import pdl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x, out, stride_x, stride_out, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    """silu(gate) is rounded to the input dtype before the product, as torch's two ops round."""
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x + row * stride_x + INTERMEDIATE + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    silu = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    product = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out + row * stride_out + cols, product.to(out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate || up  ->  silu(gate) * up, [..., I]."""
    intermediate = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * intermediate)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], intermediate, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        grid = (rows.shape[0], triton.cdiv(intermediate, _BLOCK))
        _silu_and_mul_kernel[grid](
            rows, out, rows.stride(0), out.stride(0), INTERMEDIATE=intermediate, BLOCK=_BLOCK, num_warps=4,
            **pdl.launch_args(x),
        )  # fmt: skip
    return out.view(*x.shape[:-1], intermediate)
