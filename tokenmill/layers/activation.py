"""SiLU-and-multiply, the gate of the Llama MLP."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import get_kernels


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_kernels(x.device).silu_and_mul(x)
