"""FusedMoE's reference forward against a dense computation (every expert on every token, weighted by
the router's top-k), on awkward sizes with experts that receive no token; its loader takes per-expert
tensors and names the ones a checkpoint lacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.fused_moe import FusedMoE, expert_params_mapping
from tokenmill.models.utils import load_model_weights


def dense_reference(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1, dtype=torch.float32)
    weights, chosen = torch.topk(probs, moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for expert in range(moe.num_experts):
        gate, up = F.linear(x, moe.experts.w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, moe.experts.w2[expert])
        weight = (weights * (chosen == expert)).sum(-1, keepdim=True).to(x.dtype)
        out += y * weight
    return out


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "renormalize"),
    [(1, 3, 1, False), (13, 7, 3, True), (37, 16, 2, False), (5, 9, 9, True)],
)
def test_matches_a_dense_computation(tokens: int, experts: int, top_k: int, renormalize: bool) -> None:
    torch.manual_seed(tokens)
    moe = FusedMoE(experts, top_k, hidden_size=24, intermediate_size=20, renormalize=renormalize)
    for param in moe.parameters():
        param.data.normal_(0, 0.3)
    direction = torch.ones(24) / 24**0.5
    x = torch.randn(tokens, 24) + 5 * direction
    if tokens > 1:  # every token leans along `direction`, which the last expert's router row opposes
        moe.gate.weight.data[:-1] += direction
        moe.gate.weight.data[-1] = -3 * direction
    chosen, _ = moe.route(x)
    assert tokens == 1 or top_k == experts or not (chosen == experts - 1).any()
    torch.testing.assert_close(moe(x), dense_reference(moe, x), rtol=1e-5, atol=1e-5)


def test_loads_per_expert_tensors_and_names_the_missing_ones() -> None:
    moe = FusedMoE(3, 2, hidden_size=8, intermediate_size=4, renormalize=True)
    model = torch.nn.Module()
    model.mlp = moe
    tensors = {"mlp.gate.weight": torch.randn(3, 8)}
    for e in range(3):
        tensors |= {f"mlp.experts.{e}.gate_proj.weight": torch.randn(4, 8), f"mlp.experts.{e}.up_proj.weight":
                    torch.randn(4, 8), f"mlp.experts.{e}.down_proj.weight": torch.randn(8, 4)}  # fmt: skip
    load_model_weights(model, tensors.items(), expert_params_mapping(3))
    assert torch.equal(moe.experts.w13[2, :4], tensors["mlp.experts.2.gate_proj.weight"])
    assert torch.equal(moe.experts.w13[2, 4:], tensors["mlp.experts.2.up_proj.weight"])
    assert torch.equal(moe.experts.w2[1], tensors["mlp.experts.1.down_proj.weight"])
    del tensors["mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors.*experts\.1\.up_proj"):
        load_model_weights(model, tensors.items(), expert_params_mapping(3))
    tensors["mlp.experts.1.up_proj.weight"] = torch.randn(5, 8)
    with pytest.raises(ValueError, match="experts.1.up_proj.weight.*does not match"):
        load_model_weights(model, tensors.items(), expert_params_mapping(3))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(3, 4, hidden_size=8, intermediate_size=4, renormalize=True)
