"""Quantized linear layers: a method object per layer (layers/linear.py's LinearMethodBase) that owns the
layer's stored weights and its matmul.

A checkpoint that says how it was quantized (`quantization_config` in config.json) is built with its
scheme's method on every linear layer, so its tensors load as they are stored; the layers its ignore
list names are rebuilt unquantized. Supported: compressed-tensors FP8 and W4A16 (compressed_tensors.py),
GPTQ and AWQ 4-bit (gptq_awq.py), fine-grained FP8 with block scales (fp8_block.py), NVIDIA Model
Optimizer's FP8 (modelopt.py). A MoE checkpoint's
quantized experts stay quantized where the fused MoE kernel runs the scheme, else are dequantized as
they load (moe_experts.py).

Online FP8 (`fp8`) loads the checkpoint in the model dtype and quantizes each linear's weight once the
weights are in (per output channel, e4m3); activations are quantized per token at run time. A MoE
model's experts are quantized the same way (one scale per row) and run with activations in the model
dtype. Online INT4 (`int4`) is W4A16: symmetric round-to-nearest groups of 128 input columns, no
calibration, the experts' too. The embedding and the LM head stay in the model dtype, as the
checkpoint formats' ignore lists keep them.
"""

from __future__ import annotations

from torch import nn

from tokenmill.config import QUANTIZATION_METHODS
from tokenmill.layers.quantization.compressed_tensors import CompressedTensorsConfig
from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, check_fp8_support
from tokenmill.layers.quantization.fp8_block import Fp8BlockConfig
from tokenmill.layers.quantization.gptq_awq import GptqAwqConfig
from tokenmill.layers.quantization.int4 import quantize_linear_int4
from tokenmill.layers.quantization.modelopt import ModelOptConfig, is_modelopt

CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "modelopt")
# The --quantization values that only name a checkpoint's format (fp8 also quantizes a bf16 one at load).
_CHECKPOINT_ONLY = tuple(method for method in CHECKPOINT_METHODS if method != "fp8")
# --quantization values that name a checkpoint of another quant_method too, as vLLM takes them: fp8 for
# Model Optimizer's FP8 checkpoints.
_ALSO_NAMES = {"modelopt": ("fp8",)}


CheckpointScheme = CompressedTensorsConfig | GptqAwqConfig | Fp8BlockConfig | ModelOptConfig


def checkpoint_quantization(hf_config, requested: str | None) -> CheckpointScheme | None:
    """The scheme a checkpoint was saved in, from its config's quantization_config (None when it has
    none). `requested` (--quantization) must agree with it: online fp8 of a quantized checkpoint, or a
    checkpoint scheme named for an unquantized checkpoint, is an error."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict()
    if raw is None:
        if requested in _CHECKPOINT_ONLY:
            raise ValueError(
                f"quantization={requested!r} names a checkpoint format, but the checkpoint's config.json "
                "has no quantization_config."
            )
        return None
    method = "modelopt" if is_modelopt(raw) else raw.get("quant_method")
    if requested is not None and requested != method and requested not in _ALSO_NAMES.get(method, ()):
        raise ValueError(
            f"quantization={requested!r} does not match the checkpoint, which is quantized with "
            f"quantization_config.quant_method {method!r}; drop --quantization."
        )
    if method == "compressed-tensors":
        return CompressedTensorsConfig(raw)
    if method in ("gptq", "awq"):
        return GptqAwqConfig(raw)
    if method == "fp8":
        return Fp8BlockConfig(raw)
    if method == "modelopt":
        return ModelOptConfig(raw)
    raise ValueError(
        f"quantization_config.quant_method {method!r} is not supported (supported: "
        f"{', '.join(CHECKPOINT_METHODS)})."
    )


def quantize_model(model: nn.Module, method: str | None) -> int:
    """Put every linear layer of `model` on the `method` scheme once its weights are loaded (each MoE
    layer's experts too); returns how many layers (and expert stacks) were converted. `method`
    None leaves the model as it is."""
    if method is None or method in _CHECKPOINT_ONLY:
        return 0
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {method!r}.")
    from tokenmill.layers.fused_moe import Experts
    from tokenmill.layers.linear import LinearBase

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    if method == "int4":
        for layer in layers:
            quantize_linear_int4(layer)
    else:
        check_fp8_support(next(model.parameters()).device)
        for layer in layers:
            layer.quant_method = Fp8LinearMethod()
            layer.quant_method.process_weights_after_loading(layer)
    for held in experts:  # the experts too, as vLLM's Fp8MoEMethod quantizes them (run W8A16 / W4A16)
        held.quantize(method)
    return len(layers) + len(experts)
