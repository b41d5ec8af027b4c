"""fused_linear: a linear layer with the activation after it folded into its one-row GEMV where the quant
method's kernel can (decode of a few rows on a GPU), else in a launch of its own."""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.kernels import GemvFusion
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


def fused_linear(layer: LinearBase, x: torch.Tensor, *, act: nn.Module | None = None) -> torch.Tensor:
    """act(layer(x)), with act (SiluAndMul: SiLU-and-multiply of the output's gate || up halves) done as
    the output is stored where a one-row kernel takes x (decode of a few sequences on a GPU; the quant
    method's gemv_takes) and GEMV_FUSION names "act"; else (other activations, and always with tensor
    parallelism) in a launch of its own."""
    if isinstance(act, SiluAndMul) and gemv_fusion_takes(layer, x, "act"):
        return layer.quant_method.gemv(layer, x, layer.bias, GemvFusion(silu_mul=True))
    y = layer(x)
    return y if act is None else act(y)


def gemv_fusion_takes(layer: LinearBase, x: torch.Tensor, part: str) -> bool:
    """Whether fused_linear folds GEMV_FUSION's `part` into layer's GEMV for activations like x (their
    rows, dtype and device)."""
    return part in GEMV_FUSION and layer.tp_size == 1 and layer.quant_method.gemv_takes(layer, x)
