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
    """A ValueError naming the first width tp_size does not split, before any rank is started: the heads
    (as QKVParallelLinear splits them), the dense MLP's width, and the experts' width (or, with expert
    parallelism, their number)."""
    from tokenmill.layers.sharding import divide, heads_per_rank
    from tokenmill.models.llama import ArchFlags

    flags = ArchFlags(config)
    heads_per_rank(flags.num_heads, flags.num_kv_heads, tp_size)
    if not flags.mixtral:  # Mixtral's intermediate_size is its experts' width
        divide(config.intermediate_size, tp_size, "intermediate_size")
    if flags.num_experts and expert_parallel:
        divide(flags.num_experts, tp_size, "num_experts")
    elif flags.num_experts:
        divide(flags.moe_intermediate_size, tp_size, "moe_intermediate_size")
