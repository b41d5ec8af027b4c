"""INT8 linears with one scale per output row: llm-compressor's W8A8 INT8 (compressed-tensors'
`int-quantized` format: int8 `weight`, activations quantized to int8 per token at run time or through a
calibrated per-tensor `input_scale`) and its INT8 weight-only checkpoints (`pack-quantized` with 8 bits:
four values a word, each stored as q + 128; unpacked to int8 as they load), and GPTQ's 8-bit checkpoints
(int8 in groups of input columns with zero points: `int8_grouped_linear`). The layer methods that read
them are per_row_scaled.py's CompressedTensorsInt8LinearMethod and gptq_awq.py's; this module holds
their arithmetic.

How a product runs:
- decode-sized batches on CUDA (at most SKINNY_MAX_ROWS rows): kernels/skinny_gemm.py's w8a16_skinny,
  whose loads widen whatever 8-bit weight they read, e4m3 or int8: W8A16, as FP8 checkpoints run there
  (no activation quantization launch, one read of the weight); weight-only checkpoints up to
  GROUPED_MAX_ROWS rows through w8a16_grouped (one group of K columns), past them dequantized in one
  Triton pass (kernels/dequant8.py) for cuBLAS;
- larger batches on CUDA with int8 activations: the activations quantized per token (or by the static
  scale) in one launch (kernels/fp8_quant.py), then kernels/fp8_gemm.py's row-wise-scaled GEMM on int8
  operands (int8 tensor cores, exact int32 sums; why not cuBLAS's torch._int_mm: see there);
- everywhere else (the CPU): the reference, the library's fake-quantized arithmetic in fp32:
  (x_q * x_scale) @ (w_q * w_scale)^T.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels import GROUPED_MAX_ROWS, QuantizedRows, RowQuant, skinny_kernel, triton_kernel
from tokenmill.kernels.quant_reference import dequantize_8bit_groups

INT8_MAX = 127
# compressed-tensors' symmetric int8 range: a scale is the largest magnitude over half of 255 values
# (calculate_qparams), so a row's largest value lands on 127.5 and rounds to the clamp at 127. Dynamic
# activation scales are computed the same way, so that the checkpoint runs as it was calibrated.
INT8_HALF_RANGE = 127.5


def quantize_int8_per_row(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (int8 [R, C], fp32 scales [R, 1]) with x ~= q * scale, symmetric, round half to even:
    each row's own scale (its largest magnitude at 127.5 steps), or the per-tensor static_scale (one
    value: a checkpoint's calibrated input scale) for every row. One Triton launch on CUDA
    (kernels/fp8_quant.py), quantize_int8_reference elsewhere."""
    if x.is_cuda and x.dim() == 2:
        fused = triton_kernel("fp8_quant", "quantize_int8_per_row")
        if fused is not None:
            return fused(x, static_scale)
    return quantize_int8_reference(x, static_scale)


def quantize_int8_reference(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8_per_row in torch: the reference of the Triton launch, bit for bit."""
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float().expand(x.shape[0], 1).contiguous()
    else:
        scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / INT8_HALF_RANGE
    return _round_int8(x.float() / scale), scale


def _round_int8(values: torch.Tensor) -> torch.Tensor:
    return torch.round(values).clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)


def int8_linear(
    x: torch.Tensor | QuantizedRows,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scheme: str | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + b with W stored as (w_q int8 [N, K], w_scale fp32 [N, 1]); x [..., K] quantized per
    token (input_scheme "token"), by the per-tensor input_scale ("tensor"), or not at all (None:
    weight-only, W8A16), or already quantized so by the launch that made it (QuantizedRows, where
    int8_row_quant asked for it). See the module's docstring for which path takes a call."""
    if isinstance(x, QuantizedRows):
        shape, dtype, x_q, x_scale = x.shape, x.dtype, x.values, x.scale
    else:
        if input_scheme is None:  # weight-only: one group of K columns (int8_grouped_linear's skinny path)
            return int8_grouped_linear(x, w_q, w_scale.reshape(-1, 1), None, w_q.shape[1], bias)
        skinny = skinny_kernel(x, "w8a16_skinny")
        if skinny is not None:
            return skinny(x, w_q, w_scale, bias)
        shape, dtype = x.shape, x.dtype
        static = None if input_scheme == "token" else input_scale
        x_q, x_scale = quantize_int8_per_row(x.reshape(-1, shape[-1]), static)
    gemm = triton_kernel("fp8_gemm", "fp8_rowwise_gemm") if x_q.is_cuda else None
    if gemm is not None:
        y = gemm(x_q, x_scale, w_q, w_scale, bias, dtype)
    else:
        y = (x_q.float() * x_scale) @ (w_q.float() * w_scale.reshape(-1, 1).float()).t()
        y = (y + bias.float() if bias is not None else y).to(dtype)
    return y.reshape(*shape[:-1], w_q.shape[0])


def int8_row_quant(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> RowQuant | None:
    """What int8_linear (with activation scales) would quantize x's rows to, for the launch that makes x
    to do in its stores; None where it multiplies x as it is (the skinny kernel's decode sizes)."""
    if skinny_kernel(x, "w8a16_skinny") is not None:
        return None
    return RowQuant(True, input_scale, quantize_int8_per_row)


def unpack_int8(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """compressed-tensors' 8-bit pack-quantized words [R, ceil(C/4)] int32 -> int8 [R, C]: value i of a
    word in bits 8i..8i+7 (little-endian bytes), stored as q + 128."""
    if packed.dtype != torch.int32:
        raise ValueError(f"8-bit packed weights are int32 words, got {packed.dtype}")
    values = packed.contiguous().view(torch.uint8).reshape(packed.shape[0], -1).to(torch.int16) - 128
    if values.shape[1] < columns:
        raise ValueError(f"8-bit packed weights hold {values.shape[1]} columns, fewer than {columns}")
    return values[:, :columns].to(torch.int8)


def int8_grouped_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T + b, W int8 in groups (GPTQ's 8-bit; per channel with group_size K; dequantize_8bit_groups
    says how): per channel without zero points, decode's rows take INT8 weight-only's skinny kernels;
    otherwise batches of up to GROUPED_MAX_ROWS rows on CUDA through kernels/grouped_w8a16.py's
    w8a16_grouped (the weight read once a block of rows, a byte a value); larger ones (prefill) dequantize
    the weight into x's dtype in one Triton pass (kernels/dequant8.py) for cuBLAS; the CPU does the same
    through the torch reference."""
    rows = x.numel() // max(x.shape[-1], 1)
    if zero is None and scale.shape[1] == 1:  # per channel, symmetric: INT8 weight-only's one-row kernels
        skinny = skinny_kernel(x, "w8a16_skinny")
        if skinny is not None:
            return skinny(x, w_q, scale, bias)
    if x.is_cuda and rows <= GROUPED_MAX_ROWS and group_size % 16 == 0:
        grouped = triton_kernel("grouped_w8a16", "w8a16_grouped")
        if grouped is not None:
            return grouped(x, w_q, scale, zero, group_size, bias)
    dequantize = dequantize_8bit_groups
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        dequantize = triton_kernel("dequant8", "dequantize_8bit_groups") or dequantize
    return F.linear(x, dequantize(w_q, scale, zero, group_size, x.dtype), bias)
