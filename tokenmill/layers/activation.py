"""The gated activation of the Llama MLP: act(gate) * up over the gate/up projection's two halves. SiLU
(the family's own, `hidden_act: silu`) runs in the kernel set's one launch and folds into the one-row
GEMVs' stores (layers/fused_linear.py); the GELU and ReLU variants a config may name run as torch ops,
as transformers computes them."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import Kernels, QuantizedRows, RowQuant, ScaledRows, get_kernels, reference, resolved

# hidden_act -> the torch function of the gate (None: SiLU, SiluAndMul's kernels).
_GATES = {
    "silu": None,
    "swish": None,
    "gelu": lambda x: nn.functional.gelu(x),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
}


class SiluAndMul(nn.Module):
    def __init__(self, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels or get_kernels()

    def forward(
        self, x: torch.Tensor | ScaledRows, quant: RowQuant | None = None
    ) -> torch.Tensor | QuantizedRows:
        """quant: the output comes quantized as it asks, in the same launch where the kernel set has one;
        x may be the gate/up product with its scales left to this launch (ScaledRows)."""
        if quant is not None:
            return self.kernels.silu_and_mul_quant(x, quant)
        return self.kernels.silu_and_mul(x)


class GatedActivation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.gate = _GATES[name]

    def forward(
        self, x: torch.Tensor | ScaledRows, quant: RowQuant | None = None
    ) -> torch.Tensor | QuantizedRows:
        gate, up = resolved(x).chunk(2, dim=-1)
        out = self.gate(gate) * up
        return out if quant is None else reference.quantize_rows(out, quant)


def check_hidden_act(name: str) -> None:
    if name not in _GATES:
        raise ValueError(f"hidden_act {name!r} is not supported (supported: {', '.join(_GATES)}).")


def gated_activation(name: str, kernels: Kernels) -> nn.Module:
    """The MLP's act(gate) * up for the config's hidden_act; a ValueError naming it when unknown."""
    check_hidden_act(name)
    return SiluAndMul(kernels) if _GATES[name] is None else GatedActivation(name)
