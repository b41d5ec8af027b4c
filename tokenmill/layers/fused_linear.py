"""fused_linear: a linear layer with the norm before it, the activation and the residual add after it
folded into its one-row GEMV where the quant method's kernel can (decode of a few rows on a GPU), else in
launches of their own."""

from __future__ import annotations

import os

import torch
from torch import nn

from tokenmill.kernels import GemvFusion
from tokenmill.layers.linear import LinearBase

# What fused_linear folds into the one-row GEMVs (TOKENMILL_GEMV_FUSION: a comma list of these parts, 1
# for both, 0 for none): "act" SiLU-and-multiply in the gate/up projection's store; "norm" the norms in
# the loads of the projections after them and the residual adds in the stores of those before (the layers
# on the residual stream alone, models/llama.py). By default "act" alone: it made the H200's 8B batch-1
# step faster (bench_pdl.py, 2026-12-04), INT4 2.173 -> 2.145 ms, FP8 2.536 -> 2.516 and 2.515 -> 2.495
# (two calls), bf16 3.983 -> 3.981. "norm" measured slower and stays off (the first form of both, the norm
# computed in every program's loads and the SiLU in the down projection's, had been slower too: bf16
# 4.113 -> 4.184 ms, FP8 2.623 -> 2.895, INT4 2.243 -> 2.629, 2026-12-03; docs/performance.md).
# TOKENMILL_GEMV_FUSION=0 turns every part off.
GEMV_FUSION_PARTS = ("act", "norm")


def _gemv_fusion(value: str) -> frozenset[str]:
    parts = frozenset(
        GEMV_FUSION_PARTS if value == "1" else (p for p in value.split(",") if p not in ("", "0"))
    )
    if not parts <= set(GEMV_FUSION_PARTS):
        raise ValueError(f"TOKENMILL_GEMV_FUSION={value!r}: name parts of {GEMV_FUSION_PARTS}, 1 or 0")
    return parts


GEMV_FUSION = _gemv_fusion(os.environ.get("TOKENMILL_GEMV_FUSION", "act"))


def fused_linear(
    layer: LinearBase,
    x: torch.Tensor,
    *,
    norm: nn.Module | None = None,
    act: nn.Module | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """act(layer(norm(x))) + residual, with the launches around the layer folded into its GEMV where a
    one-row kernel takes x (decode of a few sequences on a GPU; the quant method's gemv_takes) and
    GEMV_FUSION names the part: norm (an RMSNorm; x is the residual stream) as x is loaded, act
    (SiLU-and-multiply of the output's gate || up halves) and the residual add as the output is stored.
    The rest (and everything with tensor parallelism, whose all-reduce comes between the GEMV and the
    add) in launches of its own."""
    fold_norm = norm is not None and gemv_fusion_takes(layer, x, "norm")
    fold_act = act is not None and gemv_fusion_takes(layer, x, "act")
    fold_residual = residual is not None and not fold_act and gemv_fusion_takes(layer, x, "norm")
    if norm is not None and not fold_norm:
        x = norm(x)
    if fold_norm or fold_act or fold_residual:
        fusion = GemvFusion(
            norm.weight if fold_norm else None, norm.eps if fold_norm else 0.0, fold_act,
            residual if fold_residual else None,
        )  # fmt: skip
        y = layer.quant_method.gemv(layer, x, layer.bias, fusion)
    else:
        y = layer(x)
    if act is not None and not fold_act:
        y = act(y)
    if residual is not None and not fold_residual:
        y = y + residual
    return y


def gemv_fusion_takes(layer: LinearBase, x: torch.Tensor, part: str) -> bool:
    """Whether fused_linear folds GEMV_FUSION's `part` into layer's GEMV for activations like x (their
    rows, dtype and device)."""
    return part in GEMV_FUSION and layer.tp_size == 1 and layer.quant_method.gemv_takes(layer, x)
