"""Which class runs which Hugging Face architecture name."""

from __future__ import annotations

from torch import nn

from tokenmill.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    # Bare models (no LM head): embedding checkpoints, served by the pooling runner.
    "LlamaModel": LlamaForCausalLM,
    "MistralModel": LlamaForCausalLM,
    "Qwen2Model": LlamaForCausalLM,
    "Qwen3Model": LlamaForCausalLM,
}


def is_bare_model(config) -> bool:
    """True for a checkpoint of a bare model (Qwen3Model, LlamaModel, ...): hidden states, no LM head."""
    architectures = getattr(config, "architectures", None) or []
    return bool(architectures) and architectures[0].endswith("Model") and architectures[0] in MODEL_REGISTRY


def model_class(config) -> type[nn.Module]:
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"model architecture {architectures or '(none in config.json)'} is not supported; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}."
    )


def check_tensor_parallel(config, tp_size: int, expert_parallel: bool = False) -> None:
    """A ValueError naming the first width tp_size does not split, before any rank is started: query
    heads, KV heads (split, or replicated evenly when there are fewer than ranks), the dense MLP's width,
    and the experts' width (or, with expert parallelism, their number)."""
    from tokenmill.layers.linear import divide

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    divide(heads, tp_size, "num_heads")
    if tp_size >= kv_heads:
        if tp_size % kv_heads:
            raise ValueError(
                f"tp_size ({tp_size}) is not a multiple of num_kv_heads ({kv_heads}), so KV heads cannot be "
                "replicated evenly; pick a tp_size that is."
            )
    else:
        divide(kv_heads, tp_size, "num_kv_heads")
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0
    expert_width = getattr(config, "moe_intermediate_size", None)
    if not num_experts or expert_width:  # a dense MLP's width (Mixtral's is its experts')
        divide(config.intermediate_size, tp_size, "intermediate_size")
    if num_experts and expert_parallel:
        divide(num_experts, tp_size, "num_experts")
    elif num_experts:
        divide(expert_width or config.intermediate_size, tp_size, "moe_intermediate_size")
