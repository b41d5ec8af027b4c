"""The decoder layers on the residual stream alone (LlamaDecoderLayer.forward_stream), as a decode step of
a few rows on a GPU runs them: each norm, the activation and each residual add handed to the projection's
GEMV (layers/fused_linear.py). Here the projections' GemvFusion is done by torch ops, so the
model's side of it is checked on the CPU against transformers' greedy tokens; the kernels' side is
tests/kernels/test_skinny_gemm.py's, and both together run in the GPU tests."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ARCHS, MOE_ARCHS
from tokenmill.kernels import GemvFusion, reference
from tokenmill.layers import fused_linear as fusion_switch
from tokenmill.layers.linear import UnquantizedLinearMethod

from .test_llama_equivalence import PROMPTS, generate_ids, hf_greedy, make_llm


@pytest.fixture
def fused_projections(monkeypatch):
    """Every unquantized projection of a decode step (one or two rows) takes GemvFusion, done in torch;
    returns the fusions seen, by kind."""
    seen = {"norm": 0, "silu_mul": 0, "residual": 0}

    def gemv_takes(self, layer, x):
        return x.numel() // x.shape[-1] <= 2

    def gemv(self, layer, x, bias, fusion: GemvFusion):
        if fusion.norm_weight is not None:
            seen["norm"] += 1
            x = reference.rms_norm(x, fusion.norm_weight, fusion.eps)
        y = F.linear(x, layer.weight, bias)
        if fusion.silu_mul:
            seen["silu_mul"] += 1
            y = reference.silu_and_mul(y)
        if fusion.residual is not None:
            seen["residual"] += 1
            y = y + fusion.residual
        return y

    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset(fusion_switch.GEMV_FUSION_PARTS))
    monkeypatch.setattr(UnquantizedLinearMethod, "gemv_takes", gemv_takes)
    monkeypatch.setattr(UnquantizedLinearMethod, "gemv", gemv)
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_on_the_residual_stream_gives_transformers_tokens(arch, hf_model_dirs, fused_projections):
    path, hf_model = hf_model_dirs[arch]
    want = [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert generate_ids(make_llm(path, max_num_seqs=1), PROMPTS) == want
    # Per decoder layer and decode step: two norms, one activation, two residual adds.
    assert fused_projections["norm"] == 2 * fused_projections["silu_mul"] > 0
    assert fused_projections["residual"] == fused_projections["norm"]


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_model_with_expert_layers_keeps_the_separate_norms(arch, hf_model_dirs, fused_projections):
    path, hf_model = hf_model_dirs[arch]
    want = [hf_greedy(hf_model, prompt) for prompt in PROMPTS[:2]]
    assert generate_ids(make_llm(path, max_num_seqs=1), PROMPTS[:2]) == want
    assert fused_projections["norm"] == fused_projections["residual"] == 0


def test_fused_linear_does_the_same_work_where_no_gemv_takes_it(monkeypatch) -> None:
    """Without a one-row kernel (here: the CPU), fused_linear runs the norm, the activation and the add
    as launches of their own around the layer."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.fused_linear import fused_linear
    from tokenmill.layers.linear import RowParallelLinear
    from tokenmill.layers.norm import RMSNorm

    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset(fusion_switch.GEMV_FUSION_PARTS))
    torch.manual_seed(0)
    layer = RowParallelLinear(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    norm = RMSNorm(16, 1e-5)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    x, residual = torch.randn(3, 16), torch.randn(3, 16)
    normed = reference.rms_norm(x, norm.weight, 1e-5)
    torch.testing.assert_close(fused_linear(layer, x, norm=norm), F.linear(normed, layer.weight, layer.bias))
    act = SiluAndMul()
    gate_up_layer = RowParallelLinear(16, 32, bias=False)
    torch.nn.init.normal_(gate_up_layer.weight)
    want = reference.silu_and_mul(F.linear(normed, gate_up_layer.weight)) + residual
    got = fused_linear(gate_up_layer, x, norm=norm, act=act, residual=residual)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_on_the_gpu_the_fp8_one_row_kernels_fold_the_norms_in(arch, hf_model_dirs, monkeypatch):
    """FP8 weights (fp32 activations, so that no bf16 rounding can tip a random model's argmax): decode
    through the one-row kernel's fused loads and stores gives the tokens of the separate launches."""
    path, _ = hf_model_dirs[arch]
    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset(fusion_switch.GEMV_FUSION_PARTS))
    options = dict(max_num_seqs=1, quantization="fp8", enforce_eager=True, num_kv_blocks=64)
    fused = make_llm(path, **options)
    assert fused.engine.runner.model.model.fuses_norms(torch.zeros(1, 8, device="cuda"))
    got = generate_ids(fused, PROMPTS)
    del fused
    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset())
    assert generate_ids(make_llm(path, **options), PROMPTS) == got


def test_the_fusion_switch_names_its_parts() -> None:
    parse = fusion_switch._gemv_fusion
    assert parse("0") == parse("") == frozenset()
    assert parse("1") == frozenset(fusion_switch.GEMV_FUSION_PARTS) == frozenset({"act", "norm"})
    assert parse("norm,act") == frozenset({"act", "norm"})
    assert parse("act") == frozenset({"act"})
    with pytest.raises(ValueError, match="TOKENMILL_GEMV_FUSION='acts'"):
        parse("acts")


@pytest.mark.skipif("TOKENMILL_GEMV_FUSION" in os.environ, reason="the switch is set in the environment")
def test_the_fusion_switch_folds_the_activation_alone_by_default() -> None:
    """Unset, TOKENMILL_GEMV_FUSION folds SiLU-and-multiply into the gate/up GEMV and not the norms."""
    default = fusion_switch.GEMV_FUSION
    assert default == frozenset({"act"})
