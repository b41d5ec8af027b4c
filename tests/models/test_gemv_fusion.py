"""The activation folded into the gate/up projection's one-row GEMV (layers/fused_linear.py's GEMV_FUSION
"act"), as a decode step of a few rows on a GPU runs it: SiLU-and-multiply done as the GEMV stores its
output. Here the projection's GemvFusion is done by torch ops, so the model's side of it is checked on
the CPU against transformers' greedy tokens; the kernels' side is tests/kernels/test_skinny_gemm.py's,
and both together run in the GPU test."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import ARCHS
from tokenmill.kernels import GemvFusion, reference
from tokenmill.layers import fused_linear as fusion_switch
from tokenmill.layers.linear import MergedColumnParallelLinear, UnquantizedLinearMethod

from .test_llama_equivalence import PROMPTS, generate_ids, hf_greedy, make_llm


@pytest.fixture
def fused_projections(monkeypatch):
    """Every unquantized projection of a decode step (one or two rows) takes GemvFusion, done in torch;
    returns how many fused activations were seen."""
    seen = {"silu_mul": 0}

    def gemv_takes(self, layer, x):
        return x.numel() // x.shape[-1] <= 2

    def gemv(self, layer, x, bias, fusion: GemvFusion):
        assert fusion == GemvFusion(silu_mul=True) and isinstance(layer, MergedColumnParallelLinear)
        seen["silu_mul"] += 1
        return reference.silu_and_mul(F.linear(x, layer.weight, bias))

    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset({"act"}))
    monkeypatch.setattr(UnquantizedLinearMethod, "gemv_takes", gemv_takes)
    monkeypatch.setattr(UnquantizedLinearMethod, "gemv", gemv)
    return seen


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_with_the_fused_activation_gives_transformers_tokens(arch, hf_model_dirs, fused_projections):
    path, hf_model = hf_model_dirs[arch]
    want = [hf_greedy(hf_model, prompt) for prompt in PROMPTS]
    assert generate_ids(make_llm(path, max_num_seqs=1), PROMPTS) == want
    # One activation per decoder layer and decode step.
    layers = hf_model.config.num_hidden_layers
    assert fused_projections["silu_mul"] > 0 and fused_projections["silu_mul"] % layers == 0


def test_fused_linear_does_the_same_work_where_no_gemv_takes_it(monkeypatch) -> None:
    """Without a one-row kernel (here: the CPU), fused_linear runs the activation as a launch of its own
    after the layer."""
    from tokenmill.layers.activation import SiluAndMul
    from tokenmill.layers.fused_linear import fused_linear
    from tokenmill.layers.linear import RowParallelLinear

    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset(fusion_switch.GEMV_FUSION_PARTS))
    torch.manual_seed(0)
    layer = RowParallelLinear(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 16)
    torch.testing.assert_close(fused_linear(layer, x), F.linear(x, layer.weight, layer.bias))
    gate_up_layer = RowParallelLinear(16, 32, bias=False)
    torch.nn.init.normal_(gate_up_layer.weight)
    want = reference.silu_and_mul(F.linear(x, gate_up_layer.weight))
    torch.testing.assert_close(fused_linear(gate_up_layer, x, act=SiluAndMul()), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCHS)
def test_on_the_gpu_the_fp8_one_row_kernels_fold_the_activation_in(arch, hf_model_dirs, monkeypatch):
    """FP8 weights (fp32 activations, so that no bf16 rounding can tip a random model's argmax): decode
    through the one-row kernel's gated store gives the tokens of the separate launches."""
    path, _ = hf_model_dirs[arch]
    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset({"act"}))
    options = dict(max_num_seqs=1, quantization="fp8", enforce_eager=True, num_kv_blocks=64)
    fused = make_llm(path, **options)
    mlp = fused.engine.runner.model.model.layers[0].mlp
    x = torch.zeros(1, mlp.gate_up_proj.input_size, device="cuda")
    assert fusion_switch.gemv_fusion_takes(mlp.gate_up_proj, x, "act")
    got = generate_ids(fused, PROMPTS)
    del fused
    monkeypatch.setattr(fusion_switch, "GEMV_FUSION", frozenset())
    assert generate_ids(make_llm(path, **options), PROMPTS) == got


def test_the_fusion_switch_names_its_parts() -> None:
    parse = fusion_switch._gemv_fusion
    assert parse("0") == parse("") == frozenset()
    assert parse("1") == frozenset(fusion_switch.GEMV_FUSION_PARTS) == frozenset({"act"})
    assert parse("act") == parse("act,") == frozenset({"act"})
    with pytest.raises(ValueError, match="TOKENMILL_GEMV_FUSION='acts'"):
        parse("acts")
    with pytest.raises(ValueError, match=r"TOKENMILL_GEMV_FUSION='act,norm': name parts of \('act',\)"):
        parse("act,norm")  # the norm part is gone (slower on the H200)


@pytest.mark.skipif("TOKENMILL_GEMV_FUSION" in os.environ, reason="the switch is set in the environment")
def test_the_fusion_switch_folds_the_activation_by_default() -> None:
    """Unset, TOKENMILL_GEMV_FUSION folds SiLU-and-multiply into the gate/up GEMV."""
    default = fusion_switch.GEMV_FUSION
    assert default == frozenset({"act"})
