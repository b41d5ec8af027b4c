"""A GGUF writer for tests that lays a transformers model out the way llama.cpp's converter
(convert_hf_to_gguf.py) does: tensor names, metadata keys, the q/k permutation and rope_freqs."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

GGUFExtra = Callable[[gguf.GGUFWriter], None]


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The converter's LlamaModel.permute: interleave the two rope halves of each head's rows."""
    shape = weights.shape
    return weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def llama_cpp_rope_freqs(rope_parameters: dict, head_dim: int) -> np.ndarray:
    """The converter's rope_freqs tensor for a Llama 3 rope scaling, computed as it computes it."""
    base = rope_parameters["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor = rope_parameters["factor"]
    low_freq_factor = rope_parameters["low_freq_factor"]
    high_freq_factor = rope_parameters["high_freq_factor"]
    old_context_len = rope_parameters["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: gguf.MODEL_ARCH,
    extra: GGUFExtra | None = None,
    skip_tensors: tuple[str, ...] = (),
    split_max_tensors: int = 0,
) -> None:
    """Write `model` as an F32 GGUF file; `extra` adds metadata or tensors before the model's own. With
    `split_max_tensors`, the writer splits it into shards named as gguf-split names them."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch], split_max_tensors=split_max_tensors)
    writer.add_name("test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(
            getattr(config, "moe_intermediate_size", config.intermediate_size)
        )
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if extra is not None:
        extra(writer)
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(config.rope_parameters, head_dim))
    name_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name in skip_tensors or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        stem, suffix = name.rsplit(".", 1)
        data = tensor.numpy()
        if stem.endswith(".experts"):  # transformers' fused experts: llama.cpp's per-projection stacks
            layer = stem.split(".")[2]
            if suffix == "gate_up_proj":
                gate, up = np.split(data, 2, axis=1)
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            else:
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", np.ascontiguousarray(data))
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and stem.endswith("q_proj"):
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and stem.endswith("k_proj"):
            data = llama_cpp_permute(data, config.num_key_value_heads)
        writer.add_tensor(f"{name_map.get_name(stem)}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session", name="write_gguf")
def write_gguf_fixture() -> Callable[..., None]:
    return write_gguf
