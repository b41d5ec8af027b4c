"""SiLU-and-multiply, the gate of the Llama MLP."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import Kernels, PackedActivations, get_kernels


class SiluAndMul(nn.Module):
    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels or get_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)

    def forward_packed(self, x: torch.Tensor) -> tuple[torch.Tensor, PackedActivations]:
        """forward, its output also packed for the 4-bit GEMV after it (kernels/activation.py's Triton
        kernel: a GPU path, asked for by layers/fused_linear.py's packs_input)."""
        from tokenmill.kernels import activation

        return activation.silu_and_mul_packed(x)
