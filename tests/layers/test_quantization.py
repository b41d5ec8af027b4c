"""Quantized linears and KV cache: FP8 W8A8 per-row quantization, the GEMM against its dequantize-then-matmul
reference on awkward shapes, online FP8 and INT4 of every linear of a model, the FP8 KV cache, the planner's
bytes, and the errors users can hit."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.kernels import SKINNY_MAX_ROWS
from tokenmill.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from tokenmill.layers.quantization import quantize_model
from tokenmill.layers.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8LinearMethod,
    fp8_linear,
    fp8_linear_reference,
    quantize_per_row,
)

SHAPES = [(1, 40, 24), (7, 100, 77), (33, 64, 48), (130, 96, 200)]  # (M, K, N)


def dequantize_then_matmul(x, w, bias):
    """The scheme written out: per-token and per-channel e4m3, dequantized, multiplied in fp64."""
    xq, xs = quantize_per_row(x)
    wq, ws = quantize_per_row(w)
    y = (xq.double() * xs.double()) @ (wq.double() * ws.double()).t()
    return y if bias is None else y + bias.double()


def test_rows_are_scaled_to_the_fp8_range_and_round_trip() -> None:
    x = torch.randn(9, 50) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0.0  # an all-zero row stays zero
    q, scale = quantize_per_row(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (9, 1) and scale.dtype == torch.float32
    amax = q.float().abs().amax(dim=1)
    assert torch.allclose(amax[[0, 1, 2, 3, 5, 6, 7, 8]], torch.full((8,), FP8_MAX))
    assert (q[4].float() == 0).all()
    # e4m3 keeps 3 mantissa bits: each element within half a unit in the last place, 1/16 relative.
    error = (q.float() * scale - x).abs()
    assert (error <= x.abs() / 16 + scale * 2**-9).all()


@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_dequantize_then_matmul(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    wq, ws = quantize_per_row(w)
    got = fp8_linear(x, wq, ws, bias)
    want = dequantize_then_matmul(x, w, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    # And close to the unquantized product, within what two e4m3 roundings allow.
    exact = x.double() @ w.double().t() + bias.double()
    assert (got.double() - exact).abs().max() < 0.15 * exact.abs().max()


def test_leading_dims_are_kept() -> None:
    x = torch.randn(2, 3, 32)
    wq, ws = quantize_per_row(torch.randn(16, 32))
    assert fp8_linear(x, wq, ws, None).shape == (2, 3, 16)
    torch.testing.assert_close(
        fp8_linear(x, wq, ws, None).reshape(6, 16), fp8_linear(x.reshape(6, 32), wq, ws, None)
    )


def test_fused_layers_scale_each_output_row_on_its_own() -> None:
    qkv = QKVParallelLinear(32, 8, 4, 2, bias=False, params_dtype=torch.float32)
    mlp = MergedColumnParallelLinear(32, [40, 40], bias=False, params_dtype=torch.float32)
    for layer in (qkv, mlp):
        torch.nn.init.normal_(layer.weight)
        layer.weight.data[:8] *= 1000  # a loud first block must not crush the others' precision
        weight = layer.weight.data.clone()
        x = torch.randn(5, 32)
        layer.quant_method = Fp8LinearMethod()
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale.shape == (weight.shape[0], 1)
        torch.testing.assert_close(
            layer(x).double(), dequantize_then_matmul(x, weight, None), rtol=1e-5, atol=1e-3
        )
        quiet = (layer.weight.float() * layer.weight_scale)[8:]
        assert ((quiet - weight[8:]).abs() <= weight[8:].abs() / 16 + 1e-6).all()


def test_every_linear_of_a_model_is_quantized(hf_model_dirs) -> None:
    path, _ = hf_model_dirs["llama"]
    prompts = [[1, 5, 7, 9, 11], [1, 20, 30]]
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fp8 = LLM(path, skip_tokenizer_init=True, dtype="float32", quantization="fp8")
    linears = [m for m in fp8.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert all(isinstance(m.quant_method, Fp8LinearMethod) for m in linears)
    # The LM head and the embedding keep the model dtype.
    model = fp8.engine.runner.model
    assert model.model.embed_tokens.weight.dtype == torch.float32
    # (A random model's logits are nearly flat, so its greedy tokens say little about FP8's error: the
    # embedded model's perplexity test in tests/models/test_quantization_quality.py does.)
    b = fp8.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(len(x.outputs[0].token_ids) == 8 for x in b)


def test_unknown_scheme_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(torch.nn.Linear(2, 2), "awq-but-typo")
    assert EngineConfig(quantization="FP8").quantization == "fp8"
    # vLLM's names of its Marlin kernels are the formats they read.
    assert EngineConfig(quantization="gptq_marlin").quantization == "gptq"
    assert EngineConfig(quantization="AWQ_Marlin").quantization == "awq"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("m", "k", "n"), [*SHAPES, (1, 4096, 4096), (64, 512, 1024), (3, 4096, 14336)])
def test_scaled_mm_matches_the_reference_on_gpu(m: int, k: int, n: int) -> None:
    """Past SKINNY_MAX_ROWS rows, W8A8 (per-token activation scales, _scaled_mm); up to it, the skinny
    kernel's W8A16 (the activations as they are)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    gen = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
    wq, ws = quantize_per_row(torch.randn(n, k, generator=gen, device="cuda").bfloat16())
    bias = torch.randn(n, generator=gen, device="cuda").bfloat16()
    got = fp8_linear(x, wq, ws, bias)
    if m <= SKINNY_MAX_ROWS:
        want = x.float() @ (wq.float() * ws).t() + bias.float()
    else:
        xq, xs = quantize_per_row(x)
        want = fp8_linear_reference(xq, xs, wq, ws, bias, torch.float32)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 6,
    "num_experts_per_tok": 2, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}  # fmt: skip


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8", "int4"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_the_planner_and_the_engine_agree_on_weight_bytes(weight_dtype: str, moe: bool, tmp_path) -> None:
    """A MoE model's experts are quantized too (held quantized, their scales in buffers beside them)."""
    import json

    from tokenmill.layers.fused_moe import Experts
    from tokenmill.plan.memory import weight_bytes
    from tokenmill.plan.model_shape import from_hf_config

    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 2, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 4096, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    } | (MOE_CONFIG if moe else {})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=256,
        num_kv_blocks=16,
        quantization=None if weight_dtype == "bf16" else weight_dtype,
    )
    model = llm.engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == (2 if moe else 0)
    assert all(
        held.w13.dtype == {"bf16": torch.bfloat16, "fp8": FP8_DTYPE, "int4": torch.int32}[weight_dtype]
        for held in experts
    )
    engine = sum(p.numel() * p.element_size() for p in model.parameters())
    engine += sum(b.numel() * b.element_size() for held in experts for b in held.buffers())
    planned = weight_bytes(from_hf_config(config, "test"), weight_dtype).total
    # The planner leaves out FP8's per-channel fp32 scales: 4 bytes per 1,024-wide row here, 0.4% (per
    # 768-wide row of the experts' down projection, 0.5%).
    # INT4 counts as it is stored: half a byte a weight and a bf16 scale per 128 (no zero points).
    assert engine == pytest.approx(planned, rel=0.006 if weight_dtype == "fp8" else 1e-9)


def test_fp8_kv_cache_doubles_the_tokens_and_agrees_with_the_planner(tmp_path) -> None:
    import json

    from tokenmill.plan.memory import kv_bytes_per_token
    from tokenmill.plan.model_shape import from_hf_config

    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = from_hf_config(config, "test")
    blocks = {}
    for kv_dtype, planned in (("auto", "bf16"), ("fp8", "fp8")):
        llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=256, kv_cache_memory=8 << 20, kv_cache_dtype=kv_dtype)  # fmt: skip
        runner = llm.engine.runner
        assert runner.kv_bytes_per_block() == kv_bytes_per_token(shape, planned) * runner.block_size
        blocks[kv_dtype] = llm.engine.core.scheduler.kv.pool.num_blocks
        from tokenmill import SamplingParams

        (out,) = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4))
        assert len(out.outputs[0].token_ids) == 4
    assert blocks["fp8"] // 2 == blocks["auto"]  # the same bytes hold twice the blocks (floored)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_online_int4_quantizes_every_linear_to_groups_of_128(hf_model_dirs) -> None:
    from tokenmill import SamplingParams
    from tokenmill.kernels.quant_reference import dequantize_int4
    from tokenmill.layers.quantization.int4 import Int4W4A16LinearMethod

    path, _ = hf_model_dirs["qwen3"]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", quantization="int4")
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, Int4W4A16LinearMethod) for m in linears)
    layer = linears[0]
    assert layer.int4_group_size == 128 and not hasattr(layer, "weight")
    x = torch.randn(5, layer.int4_in_features)
    weight = dequantize_int4(
        layer.weight_packed, layer.weight_scale, None, 128, layer.int4_in_features, torch.float32
    )
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, layer.bias))
    (out,) = llm.generate(
        prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3), use_tqdm=False
    )
    assert len(out.outputs[0].token_ids) == 3


def test_gptq_spreads_rounding_error_to_keep_the_outputs_closer_than_rounding_alone() -> None:
    from tokenmill.bench.gptq import gptq_quantize

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)
    x = torch.randn(512, 128, generator=gen) @ torch.randn(128, 128, generator=gen)  # correlated inputs
    q, scale, zero = gptq_quantize(w, x.double().t() @ x.double(), group_size=32)
    groups = torch.arange(128) // 32
    assert q.min() >= 0 and q.max() <= 15 and scale.shape == (4, 48) and zero.shape == (4, 48)
    gptq = (q - zero[groups].t()) * scale[groups].t()
    # Round-to-nearest with each group's own range, for comparison.
    blocks = w.double().reshape(48, 4, 32)
    lo, hi = blocks.amin(-1).clamp(max=0), blocks.amax(-1).clamp(min=0)
    s = ((hi - lo) / 15).clamp(min=1e-8)
    z = torch.round(-lo / s).clamp(0, 15)
    rtn = (
        (torch.round(blocks / s[..., None] + z[..., None]).clamp(0, 15) - z[..., None]) * s[..., None]
    ).reshape(48, 128)
    error = lambda wq: (x.double() @ (wq - w.double()).t()).norm()  # noqa: E731
    assert error(gptq) < 0.8 * error(rtn)


def test_refining_rounds_never_raise_the_layers_output_error(monkeypatch) -> None:
    """_quantize_into's rounds (GPTQ's codes under the refit scales, then scales refit to them) keep the
    best of what they find: the output error with rounds is at most the one-pass error, and the packed
    tensors dequantize to the weight the layer is left with."""
    from tokenmill.bench import gptq
    from tokenmill.bench import quant_checkpoints as qc

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(768, 256, generator=gen) @ torch.randn(256, 256, generator=gen)
    hessian = x.double().t() @ x.double()
    weight = torch.randn(40, 256, generator=gen)
    errors = {}
    for rounds in (0, 2):
        monkeypatch.setattr(qc, "REFINE_ROUNDS", rounds)
        linear = torch.nn.Linear(256, 40, bias=False)
        linear.weight.data = weight.clone()
        tensors: dict = {}
        qc._quantize_into(tensors, "layer", linear, hessian, group_size=64)
        groups = torch.arange(256) // 64
        q = torch.stack([(tensors["layer.qweight"].long() >> (4 * j)) & 15 for j in range(8)], 1).reshape(
            256, 40
        )
        zero = (
            torch.stack([(tensors["layer.qzeros"].long() >> (4 * j)) & 15 for j in range(8)], 2).reshape(
                4, 40
            )
            + 1
        )
        scale = tensors["layer.scales"].double()
        dequantized = (q.t() - zero[groups].t()) * scale[groups].t()
        torch.testing.assert_close(dequantized.float(), linear.weight.data)
        errors[rounds] = gptq.output_error(weight, hessian, q.t(), scale, zero.double(), 64)
    assert errors[2] <= errors[0]


def test_compensated_target_matches_full_precision_outputs_from_perturbed_inputs() -> None:
    """The target GPTQ quantizes: the whole way (blend 1) it reproduces, on the quantized path's inputs,
    the full-precision layer's outputs on its own; blend mixes it with the weight (the maker uses
    COMPENSATE); and it is the weight where the inputs agree (the damping shrinks only the correction)."""
    from tokenmill.bench import gptq

    gen = torch.Generator().manual_seed(2)
    x_fp = torch.randn(1024, 64, generator=gen) @ torch.randn(64, 64, generator=gen)
    # Inputs bent by the layers before (a linear distortion, which a linear layer can undo).
    x_q = x_fp @ (torch.eye(64) + 0.1 * torch.randn(64, 64, generator=gen))
    weight = torch.randn(24, 64, generator=gen)
    hessian, cross = x_q.double().t() @ x_q.double(), gptq.cross_statistics([x_fp], [x_q])
    mismatch = lambda w: (x_fp.double() @ weight.double().t() - x_q.double() @ w.double().t()).norm()  # noqa: E731
    full = gptq.compensated_target(weight, hessian, cross, blend=1.0)
    assert mismatch(full) < 0.1 * mismatch(weight)
    torch.testing.assert_close(
        gptq.compensated_target(weight, hessian, cross, blend=0.5), (weight + full) / 2
    )
    same = gptq.compensated_target(
        weight, x_fp.double().t() @ x_fp.double(), gptq.cross_statistics([x_fp], [x_fp]), blend=1.0
    )
    torch.testing.assert_close(same, weight)
