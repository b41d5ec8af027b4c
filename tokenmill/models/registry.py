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
