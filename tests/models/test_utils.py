"""The generic weight-loading loop, through a small Llama: routing of fused names, skips, and the three
errors (unknown tensor, wrong shape, missing tensors)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from tokenmill.layers.linear import MergedColumnParallelLinear
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.utils import default_weight_loader, load_model_weights

SMALL = dict(
    vocab_size=101,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    architectures=["LlamaForCausalLM"],
)


def checkpoint(tie_word_embeddings: bool) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    config = LlamaConfig(**SMALL, tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(0)
    return config, dict(HFLlamaForCausalLM(config).state_dict())


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_every_tensor_lands_in_its_parameter_or_shard(tie_word_embeddings: bool) -> None:
    config, weights = checkpoint(tie_word_embeddings)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # older checkpoints carry it
    model = LlamaForCausalLM(config, max_position=64)
    model.load_weights(weights.items())
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    prefix = "model.layers.1."
    expected_qkv = torch.cat([weights[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(attn.qkv_proj.weight, expected_qkv, rtol=0, atol=0)
    expected_gate_up = torch.cat([weights[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(mlp.gate_up_proj.weight, expected_gate_up, rtol=0, atol=0)
    embed = model.model.embed_tokens.weight
    torch.testing.assert_close(embed[:101], weights["model.embed_tokens.weight"], rtol=0, atol=0)
    assert (model.lm_head.weight is embed) == tie_word_embeddings
    torch.testing.assert_close(model.lm_head.weight[:101], weights["lm_head.weight"], rtol=0, atol=0)


def test_an_unknown_tensor_is_named() -> None:
    config, weights = checkpoint(tie_word_embeddings=False)
    weights["model.layers.0.self_attn.q_proj.lora_A"] = torch.zeros(2, 24)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.lora_A' matches no parameter"):
        LlamaForCausalLM(config, max_position=64).load_weights(weights.items())


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("model.layers.1.self_attn.k_proj.weight", (24, 24), (16, 24)),
        ("model.layers.0.mlp.down_proj.weight", (24, 41), (24, 40)),
        ("model.norm.weight", (25,), (24,)),
        ("model.embed_tokens.weight", (100, 24), (101, 24)),
    ],
)
def test_a_tensor_of_the_wrong_shape_is_named(name: str, shape: tuple, expected: tuple) -> None:
    config, weights = checkpoint(tie_word_embeddings=False)
    weights[name] = torch.zeros(shape)
    message = f"checkpoint tensor '{name}': shape {shape} does not match the expected {expected}"
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LlamaForCausalLM(config, max_position=64).load_weights(weights.items())


def test_missing_tensors_are_counted_and_named_by_their_checkpoint_names() -> None:
    config, weights = checkpoint(tie_word_embeddings=False)
    dropped = [
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
        "lm_head.weight",
    ]
    for name in dropped:
        del weights[name]
    with pytest.raises(ValueError, match="missing 3 tensors") as error:
        LlamaForCausalLM(config, max_position=64).load_weights(weights.items())
    assert all(repr(name) in str(error.value) for name in dropped)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(6, [4, 4], bias=False)
        self.scale = nn.Parameter(torch.zeros(3))


class Block(nn.Module):
    stacked_params_mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()


def test_a_fused_checkpoint_tensor_loads_whole_and_the_default_loader_copies() -> None:
    block = Block()
    gate_up = torch.arange(48.0).reshape(8, 6)
    weights = {"mlp.gate_up_proj.weight": gate_up, "mlp.scale": torch.arange(3.0)}
    load_model_weights(block, weights.items(), block.stacked_params_mapping)
    torch.testing.assert_close(block.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(block.mlp.scale, torch.arange(3.0), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['mlp.up_proj.weight'\]"):
        weights = {"mlp.gate_proj.weight": gate_up[:4], "mlp.scale": torch.arange(3.0)}
        load_model_weights(Block(), weights.items(), Block.stacked_params_mapping)
    with pytest.raises(ValueError, match=r"shape \(2,\) does not match the expected \(3,\)"):
        default_weight_loader(block.mlp.scale, torch.zeros(2))
