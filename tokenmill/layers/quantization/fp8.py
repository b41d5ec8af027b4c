"""FP8 (e4m3) weights with per-output-channel scales and per-token dynamic activation scales (W8A8).

On GPUs with FP8 tensor cores (compute capability 8.9+: Ada, Hopper) the matmul is `torch._scaled_mm`
with row-wise scales; elsewhere (the CPU, and shapes cuBLAS's FP8 path does not take) the same numbers
go through the reference: both operands quantized exactly as on the GPU, then dequantized and multiplied
in fp32, so quality measured on a CPU is the quality of the FP8 scheme, not of a different one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.kernels import (
    FP8_GEMM_MAX_ROWS,
    GemvFusion,
    QuantizedRows,
    RowQuant,
    ScaledRows,
    env_int,
    skinny_kernel,
    triton_kernel,
)
from tokenmill.kernels.quant_reference import quantize_fp8_per_row
from tokenmill.kernels.reference import FP8_DTYPE, FP8_MAX
from tokenmill.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from tokenmill.layers.sharding import WeightLoader

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "Fp8LinearMethod",
    "check_fp8_support",
    "fp8_linear",
    "fp8_row_quant",
    "quantize_per_row",
]


# Whether an FP8 W8A8 linear past FP8_GEMM_MAX_ROWS rows (cuBLAS's sizes) whose output goes straight into
# an RMSNorm or the gated activation (LinearBase.forward_scaled: the O, down and gate/up projections)
# leaves its scales to that launch (TOKENMILL_FP8_SCALES_AFTER=1): the product through cuBLAS's
# per-tensor FP8 GEMM at scales 1, which has split-K tiles for 128-256 rows of the 8B's O and down where
# the row-wise one (a CUTLASS kernel in torch) leaves most SMs idle (H200, twentieth session: 77 against
# 104 us a layer at 128 rows), and the per-token and per-channel scales applied by the norm or the
# activation as they load it (kernels.ScaledRows). The same scheme and scales either way; off until a
# device has timed it end to end.
SCALES_AFTER = os.environ.get("TOKENMILL_FP8_SCALES_AFTER", "0") == "1"
# The rows it does so at (TOKENMILL_FP8_SCALES_AFTER_MIN_ROWS / _MAX_ROWS; unset: every size past 64,
# cuBLAS's; from 17 to 64 rows the Triton FP8 GEMM runs, which the per-tensor GEMM may or may not beat).
SCALES_AFTER_MIN_ROWS = env_int("TOKENMILL_FP8_SCALES_AFTER_MIN_ROWS", FP8_GEMM_MAX_ROWS + 1)
SCALES_AFTER_MAX_ROWS = env_int("TOKENMILL_FP8_SCALES_AFTER_MAX_ROWS", 1 << 62)
_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 1 on `device`, made once: by the eager warm-up steps that come before every graph
    capture (a 1 made inside a capture would hold its value only once that graph had replayed)."""
    unit = _UNIT_SCALES.get(device)
    if unit is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fp8 scales_after: the unit scale must be made in an eager step before capture"
            )
        unit = _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return unit


def check_fp8_support(device: torch.device, what: str = "quantization='fp8'") -> None:
    """FP8 matmuls need FP8 tensor cores on a GPU; the CPU runs the reference (slow, exact). `what`
    names the setting or checkpoint field that asked for them, for the error."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{what} needs FP8 support (compute capability 8.9 or newer: Ada, Hopper); "
            f"{name} is {major}.{minor}. Leave FP8 out or use another GPU."
        )


def quantize_per_row(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (e4m3 [R, C], fp32 scales [R, 1]) with x ~= q * scale, each row's amax at FP8_MAX (or
    every row at a per-tensor static_scale): one Triton launch on CUDA (kernels/fp8_quant.py), the torch
    reference elsewhere."""
    if x.is_cuda and x.dim() == 2:
        fused = triton_kernel("fp8_quant", "quantize_fp8_per_row")
        if fused is not None:
            return fused(x, static_scale)
    return quantize_fp8_per_row(x, static_scale)


def fp8_linear_reference(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(x_q * x_scale) @ (w_q * w_scale)^T + bias in fp32: x_q [M, K], x_scale [M, 1], w_q [N, K],
    w_scale [N, 1]."""
    y = (x_q.float() * x_scale) @ (w_q.float() * w_scale).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
    scales_after: bool = False,
) -> torch.Tensor | ScaledRows:
    """y = x W^T + b with W stored as (w_q, w_scale); x [..., K] quantized per token, or with a
    calibrated per-tensor input_scale (a checkpoint's static activation scale) when one is given, or
    already quantized so by the launch that made it (QuantizedRows, where fp8_row_quant asked for it).
    Decode-sized batches on CUDA skip the activation quantization: the skinny W8A16 kernel multiplies
    the FP8 weight with x as it is, reading the same weight bytes with one launch instead of two. Up to
    FP8_GEMM_MAX_ROWS rows the Triton FP8 GEMM takes the quantized rows, above that cuBLAS
    (torch._scaled_mm). scales_after (a caller whose next launch applies them, where SCALES_AFTER is on,
    at SCALES_AFTER_MIN_ROWS to _MAX_ROWS rows and without a bias): the product unscaled, as ScaledRows."""
    if isinstance(x, QuantizedRows):
        shape, dtype, x_q, x_scale = x.shape, x.dtype, x.values, x.scale
        x2 = x_q
    else:
        skinny = skinny_kernel(x, "w8a16_skinny")
        if skinny is not None:
            return skinny(x, w_q, w_scale, bias)
        shape, dtype = x.shape, x.dtype
        x2 = x.reshape(-1, shape[-1])
        x_q, x_scale = quantize_per_row(x2, input_scale)
    if (
        scales_after
        and SCALES_AFTER
        and bias is None
        and SCALES_AFTER_MIN_ROWS <= x_q.shape[0] <= SCALES_AFTER_MAX_ROWS
    ):
        return _unscaled_product(x_q, x_scale, w_q, w_scale, shape, dtype)
    triton_gemm = _triton_fp8_gemm(x2)
    if triton_gemm is not None:
        y = triton_gemm(x_q, x_scale, w_q, w_scale, bias, dtype)
    elif _scaled_mm_fits(x2, w_q):
        y = torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16
        ).to(dtype)
        if bias is not None:
            y = y + bias
    else:
        y = fp8_linear_reference(x_q, x_scale, w_q, w_scale, bias, dtype)
    return y.reshape(*shape[:-1], w_q.shape[0])


def _unscaled_product(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
) -> ScaledRows:
    """x_q w_q^T with the scales left to the next launch: cuBLAS's per-tensor FP8 GEMM at scales 1 into
    bf16 (whose range holds any sum of e4m3 products; fp16's would not) on CUDA, the exact fp32 product
    elsewhere; the row scales [..., 1] (a static per-tensor scale spread over the rows) and the weight's
    per-channel scales [N] beside it."""
    rows, n = x_q.shape[0], w_q.shape[0]
    if _scaled_mm_fits(x_q, w_q):
        unit = _unit_scale(x_q.device)
        values = torch._scaled_mm(x_q, w_q.t(), scale_a=unit, scale_b=unit, out_dtype=torch.bfloat16)
    else:
        values = x_q.float() @ w_q.float().t()
    row_scale = x_scale.reshape(-1, 1).float()
    if row_scale.shape[0] != rows:
        row_scale = row_scale.expand(rows, 1)
    return ScaledRows(
        values.reshape(*shape[:-1], n), row_scale.reshape(*shape[:-1], 1), w_scale.reshape(n).float(), dtype
    )


def fp8_row_quant(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> RowQuant | None:
    """What fp8_linear would quantize x's rows to (its RowQuant), for the launch that makes x to do in its
    stores; None where it multiplies x as it is (the skinny W8A16 kernel's decode sizes)."""
    if skinny_kernel(x, "w8a16_skinny") is not None:
        return None
    return RowQuant(False, input_scale, quantize_per_row)


def fp8_gemv_takes(x: torch.Tensor) -> bool:
    """Whether fp8_linear runs x's rows through the one-row kernel (skinny_gemm.w8a16_gemv_takes), where
    fp8_gemv can do a GemvFusion's work in the same launch."""
    takes = skinny_kernel(x, "w8a16_gemv_takes")
    return takes is not None and x.numel() > 0 and takes(x.numel() // x.shape[-1])


def fp8_gemv(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
) -> torch.Tensor:
    """fp8_linear's one-row product (where fp8_gemv_takes) with `fusion`'s work in the launch."""
    return triton_kernel("skinny_gemm", "w8a16_skinny")(x, w_q, w_scale, bias, fusion=fusion)


def _triton_fp8_gemm(x: torch.Tensor) -> Callable | None:
    """kernels/fp8_gemm.py's GEMM for the batches decode runs at (up to FP8_GEMM_MAX_ROWS rows) on CUDA,
    where it outruns cuBLAS's FP8 GEMM (docs/performance.md); None elsewhere. (FP8 weights on a GPU
    passed check_fp8_support at load: it has FP8 tensor cores.)"""
    if not x.is_cuda or x.shape[0] > FP8_GEMM_MAX_ROWS:
        return None
    return triton_kernel("fp8_gemm", "fp8_rowwise_gemm")


def _scaled_mm_fits(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """cuBLAS's FP8 GEMM: CUDA tensors, and K and N multiples of 16."""
    return x.is_cuda and x.shape[-1] % 16 == 0 and w_q.shape[0] % 16 == 0 and x.shape[0] > 0


class Fp8LinearMethod(LinearMethodBase):
    """Online FP8: the layer is built and loaded as an unquantized one (`weight` in the model dtype);
    process_weights_after_loading replaces it with `weight` in e4m3 and `weight_scale` [N, 1] in fp32.
    Scales are per output channel (row), so each logical output of a merged QKV or gate/up layer is
    scaled on its own."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None,
        weight_loader: WeightLoader,
    ) -> None:
        UnquantizedLinearMethod().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
            weight_loader,
        )  # fmt: skip

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight.data
        w_q, w_scale = quantize_per_row(weight)
        del layer.weight
        layer.register_parameter("weight", nn.Parameter(w_q, requires_grad=False))
        layer.register_parameter("weight_scale", nn.Parameter(w_scale, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias)

    def apply_scaled(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | ScaledRows:
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, scales_after=True)

    def row_quant(self, layer: nn.Module, x: torch.Tensor) -> RowQuant | None:
        return fp8_row_quant(x)

    def gemv_takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return fp8_gemv_takes(x)

    def gemv(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
    ) -> torch.Tensor:
        return fp8_gemv(x, layer.weight, layer.weight_scale, bias, fusion)
