"""Triton per-row FP8 quantization: one program per row (token) finds the row's largest magnitude, then
writes the row in e4m3 scaled so that magnitude lands on 448, and the fp32 scale. One launch instead of
the five elementwise and reduction kernels the torch expression takes, for every FP8 linear's input,
which at decode batch sizes is all launch overhead. Its reference is
kernels/quant_reference.py's quantize_fp8_per_row, of the same signature."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quantize_rows_kernel(x, out, scale, K, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        v = tl.load(x + row * stride_x + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    row_scale = tl.maximum(tl.max(amax, 0), 1e-12) / 448.0
    for start in range(0, K, BLOCK):
        mask = start + cols < K
        v = tl.load(x + row * stride_x + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(v / row_scale, -448.0, 448.0)
        tl.store(out + row * stride_out + start + cols, q.to(out.dtype.element_ty), mask=mask)
    tl.store(scale + row, row_scale)


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], fp32 scales [R, 1]) with x ~= q * scale, each row's amax at 448."""
    rows, columns = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(rows, columns, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        block = min(4096, triton.next_power_of_2(max(columns, 16)))
        _quantize_rows_kernel[(rows,)](
            x,
            out,
            scale,
            columns,
            x.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4 if block >= 1024 else 1,
        )
    return out, scale
