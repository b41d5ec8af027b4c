"""RMSNorm, with the residual add fused in when a residual is passed, and the quantization of the W8A8
linear after it when a RowQuant is (layers/fused_linear.py's row_quant_for)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import Kernels, QuantizedRows, RowQuant, ScaledRows, get_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = kernels or get_kernels()

    def forward(
        self,
        x: torch.Tensor | ScaledRows,
        residual: torch.Tensor | None = None,
        quant: RowQuant | None = None,
    ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """The normalized x (of residual + x), and the new residual with one; quant: the normalized rows
        come quantized as it asks (QuantizedRows), in the same launch where the kernel set has one. x may
        be a W8A8 linear's product with its scales left to this launch (ScaledRows)."""
        if quant is not None:
            out, residual_out = self.kernels.rms_norm_quant(x, residual, self.weight, self.eps, quant)
            return out if residual is None else (out, residual_out)
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
