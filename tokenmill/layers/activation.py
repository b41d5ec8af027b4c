"""SiLU-and-multiply, the gate of the Llama MLP."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import Kernels, get_kernels


class SiluAndMul(nn.Module):
    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels or get_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)
