"""Building the model a runner serves: the architecture's module in the runner's dtype and device, its
linear layers in the checkpoint's quantized shapes when the checkpoint says it is quantized (the layers
its ignore list names rebuilt unquantized), the weights loaded (or random, for dummy weights), then
online quantization when asked for; and the KV cache's element type."""

from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.layers.cpu_packed import pack_cpu_linears
from tokenmill.layers.fused_moe import Experts, FusedMoE, experts_held_as
from tokenmill.layers.linear import LinearBase, default_linear_method, reset_to_unquantized
from tokenmill.layers.quantization import (
    check_fp8_support,
    checkpoint_quantization,
    moe_experts,
    quantize_model,
)
from tokenmill.loader import ModelSource
from tokenmill.models.registry import model_class
from tokenmill.models.utils import building_on

logger = logging.getLogger(__name__)


def build_model(
    config: EngineConfig,
    source: ModelSource,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
    lm_head: bool,
) -> nn.Module:
    stored = checkpoint_quantization(source.hf_config, config.quantization)
    if stored is not None and stored.uses_fp8:
        check_fp8_support(device, "the checkpoint's quantization_config (FP8 activations)")
    experts = moe_experts.expert_format(stored) if stored is not None else None
    with (
        building_on(device, dtype),
        default_linear_method(stored.linear_method if stored else None),
        experts_held_as(experts),
    ):
        model = model_class(source.hf_config)(source.hf_config, max_model_len, lm_head=lm_head)
        if stored is not None:
            for name, module in model.named_modules():
                if isinstance(module, LinearBase) and stored.is_ignored(name):
                    reset_to_unquantized(module)
    if source.format == "dummy":
        _init_dummy_weights(model, config.seed, device)
    else:
        weights = source.iter_weights()
        moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
        if stored is not None and moe is not None:  # quantized experts: kept so, or dense, as they load
            shape = moe_experts.MoeShape(moe.hidden_size, moe.intermediate_size, moe.num_experts)
            weights = moe_experts.experts_as_loaded(weights, stored, shape, experts)
        model.load_weights(weights)
    for module in model.modules():
        if isinstance(module, LinearBase):
            module.quant_method.after_loading(module)
    if config.quantization is not None and stored is None:  # a quantized checkpoint is used as it is
        count = quantize_model(model, config.quantization)
        logger.info("quantized %d linear layers to %s", count, config.quantization)
    pack_cpu_linears(model, device, dtype)
    return model.eval()


def kv_cache_dtype(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, model: nn.Module
) -> torch.dtype:
    """The KV cache's element type: the model's, or e4m3 for kv_cache_dtype='fp8'. An FP8 cache takes
    the per-layer K and V scales a checkpoint stores (compressed-tensors kv_cache_scheme); without them
    the scales stay 1.0: K and V stored as they are, saturated at +-448. Chosen over calibrating on the
    first prompt, which would make every later request's numerics depend on which came first; keys and
    values of the supported models stay well inside that range (the quality test's perplexity moves
    by under 1%)."""
    layers = model.attention_layers()
    stored = [layer.stored_kv_scales for layer in layers]
    if config.kv_cache_dtype != "fp8":
        if any(stored):
            logger.info("the checkpoint's KV cache scales are not used: the KV cache is %s", dtype)
        return dtype
    check_fp8_support(device, "kv_cache_dtype='fp8'")
    if not any(stored):
        logger.warning(
            "fp8 KV cache with k_scale = v_scale = 1.0 (the checkpoint has no KV scales): K and V are "
            "stored as they are, saturated at +-448"
        )
        return torch.float8_e4m3fn
    missing = [index for index, scales in enumerate(stored) if scales is None]
    if missing:
        raise ValueError(f"the checkpoint has KV cache scales for some layers but not for layers {missing}.")
    for layer, (k_scale, v_scale) in zip(layers, stored):
        layer.k_scale, layer.v_scale = k_scale, v_scale
    logger.info("fp8 KV cache with the checkpoint's per-layer K and V scales")
    return torch.float8_e4m3fn


def _init_dummy_weights(model: nn.Module, seed: int, device: torch.device) -> None:
    """Random weights of the model's shapes, also in a quantized checkpoint's layout (its config's
    `quantization_config` with load_format dummy): norms 1, 16- and 32-bit weights N(0, 0.02), FP8
    weights N(0, 1) in e4m3 beside scales that bring them to about 0.02, 4-bit weights and zero points
    random nibbles beside scales of 0.004, INT8 weights uniform beside scales of 0.02 / 74; static input
    scales 0.02. What records a shape or an order (weight_shape,
    g_idx) keeps what the layer built it with."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "scale" in name.rsplit(".", 1)[-1]:  # weight_scale, scales, weight_scale_inv, input_scale
                param.fill_(0.02 if name.endswith("input_scale") else _dummy_weight_scale(model, name))
            elif param.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
                param.copy_(values.normal_(0.0, 1.0, generator=generator).to(param.dtype))
            elif param.is_floating_point():
                param.normal_(0.0, 0.02, generator=generator)
            elif param.dtype == torch.int8 and (name.rsplit(".", 1)[-1] in _INT8_WEIGHTS or param.dim() == 3):
                param.random_(-128, 128, generator=generator)  # INT8 weights (a linear's, stacked experts')
            elif param.dtype == torch.int8:  # zero points kept unpacked, stored minus 8 as the experts' are
                param.random_(-8, 8, generator=generator)
            elif param.dim() >= 2:  # packed int4 words (experts: 3-D): every bit pattern is eight nibbles
                info = torch.iinfo(param.dtype)
                param.random_(info.min, info.max, generator=generator)
        for module in model.modules():  # quantized experts keep their scales and zero points in buffers
            if isinstance(module, Experts) and module.fmt is not None:
                for name, buffer in module.named_buffers(recurse=False):
                    if name.endswith("_scale"):
                        buffer.fill_(0.004 if module.fmt.int4 else 0.02 / 74 if module.fmt.int8 else 0.02)
                    else:
                        buffer.random_(-8, 8, generator=generator)  # stored minus 8, as the kernels read them


def _dummy_weight_scale(model: nn.Module, name: str) -> float:
    """A dummy weight scale that brings the module's random quantized weight to about N(0, 0.02): packed
    4-bit words (random nibbles) 0.004; INT8 weights (uniform over 256 values, a deviation of 74)
    0.02 / 74; FP8 (N(0, 1)) 0.02."""
    module = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    params = dict(module.named_parameters(recurse=False))
    if any(params[n].dtype == torch.int8 for n in _INT8_WEIGHTS if n in params):
        return 0.02 / 74
    packed_int4 = any(p.dtype == torch.int32 and p.dim() == 2 for p in params.values())
    return 0.004 if packed_int4 else 0.02


# What a linear's INT8 weight is named: `weight`, `weight_packed` until an 8-bit packed one has loaded,
# GPTQ's `qweight` (zero points, also int8, are named otherwise).
_INT8_WEIGHTS = ("weight", "weight_packed", "qweight")
