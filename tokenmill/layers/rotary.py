"""Rotary position embedding (rotate-half form) with the rope scalings Hugging Face configs name."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import Kernels, get_kernels

# longrope switches its factors by the whole sequence's length, past what the KV cache already holds.
# (dynamic NTK runs: inside max_position_embeddings, which bounds max_model_len, it is the default rope.)
_UNSUPPORTED_ROPE = ("longrope",)


def rope_parameters(config) -> dict:
    """The rope settings of a transformers config, in the v5 `rope_parameters` form."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention scaling) for the config's rope type."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type in _UNSUPPORTED_ROPE:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported (supported: default, dynamic, linear, "
            "llama3, yarn)."
        )
    if rope_type == "default":
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (base**exponents)
        return inv_freq, 1.0
    # The scaled variants follow transformers' own definitions exactly, so reuse them.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling type {rope_type!r} is unknown.")
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    if 2 * inv_freq.numel() != head_dim:
        raise ValueError(
            f"partial_rotary_factor {params.get('partial_rotary_factor')}: rotary over "
            f"{2 * inv_freq.numel()} of head_dim {head_dim} dimensions is not supported (the Llama "
            "family rotates the whole head)."
        )
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_position: int, kernels: Kernels | None = None) -> None:
        super().__init__()
        self.kernels = kernels or get_kernels()
        # Computed in fp32 on the CPU whatever the default device, then moved where the model lives.
        with torch.device("cpu"):
            inv_freq, attention_scaling = inverse_frequencies(config, head_dim)
            freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.cpu())
            cache = torch.cat((freqs.cos() * attention_scaling, freqs.sin() * attention_scaling), dim=-1)
        self.register_buffer("cos_sin_cache", cache.to(torch.get_default_device()), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rotary_embedding(positions, q, k, self.cos_sin_cache)
