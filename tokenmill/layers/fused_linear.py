"""fused_linear: a linear layer with the activation after it folded into its one-row GEMV where the quant
method's kernel can (decode of a few rows on a GPU), else in a launch of its own; row_quant_for: what a
W8A8 linear asks the launch that makes its input to quantize (that launch's RowQuant), so that the
linear needs no quantizing launch of its own."""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.kernels import GemvFusion, QuantizedRows, RowQuant, ScaledRows
from tokenmill.layers.activation import SiluAndMul
from tokenmill.layers.linear import LinearBase

# What fused_linear folds into the one-row GEMVs (TOKENMILL_GEMV_FUSION: a comma list of these parts, 1
# for all, 0 for none): "act", SiLU-and-multiply in the gate/up projection's store. On by default: a launch
# a layer fewer, the H200's 8B batch-1 step 0.8% faster in FP8 and 1.3% in INT4, bf16 unchanged
# (2026-12-04). The norms and residual adds folded the same way were slower and are gone (every GEMV
# program redid the norm's work); docs/performance.md has both.
GEMV_FUSION_PARTS = ("act",)


def _gemv_fusion(value: str) -> frozenset[str]:
    parts = frozenset(
        GEMV_FUSION_PARTS if value == "1" else (p for p in value.split(",") if p not in ("", "0"))
    )
    if not parts <= set(GEMV_FUSION_PARTS):
        raise ValueError(f"TOKENMILL_GEMV_FUSION={value!r}: name parts of {GEMV_FUSION_PARTS}, 1 or 0")
    return parts


GEMV_FUSION = _gemv_fusion(os.environ.get("TOKENMILL_GEMV_FUSION", "act"))

# Whether the RMSNorm and the gated activation before a W8A8 linear (FP8 or INT8 with activation scales)
# quantize their output rows in their own launch for it (TOKENMILL_ROW_QUANT_FUSION=0: off, the linear
# quantizes in a launch of its own; the same bits either way).
ROW_QUANT_FUSION = os.environ.get("TOKENMILL_ROW_QUANT_FUSION", "1") != "0"


def row_quant_for(layer: LinearBase | None, x: torch.Tensor | ScaledRows) -> RowQuant | None:
    """How the launch that makes `layer`'s input should quantize it a row at a time (the layer's
    method's row_quant, for activations with x's rows, dtype and device), or None: the launch writes
    x as it is. x may be the launch's own input where that has the rows of its output (a ScaledRows:
    its values')."""
    if layer is None or not ROW_QUANT_FUSION:
        return None
    return layer.quant_method.row_quant(layer, x.values if isinstance(x, ScaledRows) else x)


def fused_linear(
    layer: LinearBase,
    x: torch.Tensor | QuantizedRows,
    *,
    act: nn.Module | None = None,
    then: LinearBase | None = None,
) -> torch.Tensor | QuantizedRows:
    """act(layer(x)), with act (SiluAndMul: SiLU-and-multiply of the output's gate || up halves) done as
    the output is stored where a one-row kernel takes x (decode of a few sequences on a GPU; the quant
    method's gemv_takes) and GEMV_FUSION names "act"; else (other activations, and always with tensor
    parallelism) in a launch of its own, which quantizes its output for `then`, the linear layer it
    feeds, where row_quant_for asks."""
    if isinstance(act, SiluAndMul) and isinstance(x, torch.Tensor) and gemv_fusion_takes(layer, x, "act"):
        return layer.quant_method.gemv(layer, x, layer.bias, GemvFusion(silu_mul=True))
    if act is None:
        return layer(x)
    # The activation's launch takes the product with its scales not yet applied (W8A8 at cuBLAS's sizes).
    y = layer.forward_scaled(x)
    quant = row_quant_for(then, y)
    return act(y) if quant is None else act(y, quant)


def gemv_fusion_takes(layer: LinearBase, x: torch.Tensor, part: str) -> bool:
    """Whether fused_linear folds GEMV_FUSION's `part` into layer's GEMV for activations like x (their
    rows, dtype and device)."""
    return part in GEMV_FUSION and layer.tp_size == 1 and layer.quant_method.gemv_takes(layer, x)
