"""Quantized checkpoints of the embedded SmolLM2-135M, made with the compressed-tensors library, for the
quality benchmark and its test: the GGUF model dequantized to fp32, its linear layers quantized with
round-to-nearest (no calibration data), compressed and saved as llm-compressor would save them.
Needs the `compressed-tensors` package (a test dependency)."""

from __future__ import annotations

import copy
import os


def int4_smollm2(path: str, group_size: int = 64, symmetric: bool = False) -> str:
    """Save a W4A16 `pack-quantized` SmolLM2 at `path` (the LM head stays unquantized); returns path."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from tokenmill.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    gguf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(gguf.config)
    if hasattr(config, "quantization_config"):  # the GGUF marker: a model carrying it cannot be saved
        delattr(config, "quantization_config")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(gguf.state_dict())
    weights = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=symmetric, dynamic=False
    )
    scheme = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
        format="pack-quantized",
    )
    apply_quantization_config(model, scheme)
    for module in model.modules():
        args = getattr(module, "quantization_scheme", None)
        if args is None:
            continue
        w = module.weight.data
        groups = w.reshape(w.shape[0], -1, group_size)
        scale, zero = calculate_qparams(
            groups.amin(-1).reshape(-1), groups.amax(-1).reshape(-1), args.weights
        )
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    ModelCompressor(quantization_config=scheme).compress_model(model)
    model.save_pretrained(path)
    ModelCompressor(quantization_config=scheme).update_config(path)
    return path
