"""Quantized linear layers: a method object per layer (layers/linear.py's LinearMethodBase) that owns the
layer's stored weights and its matmul. `--quantization` picks one for every linear of the model.

Online FP8 (`fp8`) loads the checkpoint in the model dtype and quantizes each linear's weight once the
weights are in (per output channel, e4m3); activations are quantized per token at run time. The
embedding and the LM head stay in the model dtype, as the checkpoint formats' ignore lists keep them.
"""

from __future__ import annotations

from torch import nn

from tokenmill.config import QUANTIZATION_METHODS
from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, check_fp8_support


def quantize_model(model: nn.Module, method: str | None) -> int:
    """Put every linear layer of `model` on the `method` scheme once its weights are loaded; returns how
    many layers were converted. `method` None leaves the model as it is."""
    if method is None:
        return 0
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}.")
    from tokenmill.layers.linear import LinearBase

    device = next(model.parameters()).device
    check_fp8_support(device)
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.quant_method = Fp8LinearMethod()
        layer.quant_method.process_weights_after_loading(layer)
    return len(layers)
