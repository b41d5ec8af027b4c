"""FP8 checkpoints made by NVIDIA's Model Optimizer (nvidia-modelopt: mtq.quantize with its FP8 configs,
then export_hf_checkpoint, as the hub's nvidia/*-FP8 models were made) on small random models: loaded as
they are stored (e4m3 weights, their scales, static input scales or per-token activations, the KV cache
scales), and scored against the library's own quantized model (its fake-quantized forward) on the same
prompt. Both forms of the config: config.json's quantization_config and the older hf_quant_config.json."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import LinearBase

from .quant_models import (
    ARCHITECTURES,
    PROMPT,
    assert_config_change_refused,
    load,
    prompt_logprobs_match,
    random_model,
)

mtq = pytest.importorskip("modelopt.torch.quantization")
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402

ALGOS = {"FP8": "FP8_DEFAULT_CFG", "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN_CFG"}


def make_checkpoint(
    arch: str, path, algo: str = "FP8", kv: bool = False, extra: list | None = None, config=None
) -> torch.Tensor:
    """Quantize `arch` (or a random model of `config`) with Model Optimizer's `algo` config (and its FP8 KV
    config with `kv`; `extra` quantizer entries after them), calibrated on random prompts; export it to
    `path` and return the quantized model's logits on PROMPT."""
    if config is None:
        model = random_model(arch)
        model.config.architectures = [ARCHITECTURES[arch]]
    else:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    entries = list(getattr(mtq, ALGOS[algo])["quant_cfg"])
    if kv:
        entries += list(mtq.FP8_KV_CFG["quant_cfg"])
    recipe = {"quant_cfg": entries + list(extra or []), "algorithm": "max"}
    generator = torch.Generator().manual_seed(1)

    def calibrate(m) -> None:
        for _ in range(4):
            m(torch.randint(0, m.config.vocab_size, (2, 24), generator=generator))

    with torch.no_grad():
        model = mtq.quantize(model, recipe, calibrate)
        logits = model(torch.tensor([PROMPT])).logits[0]
    export_hf_checkpoint(model, export_dir=str(path))  # leaves the model's weights in e4m3
    return logits


def fp8_linears(llm) -> list[LinearBase]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_fp8_with_static_input_scales_matches_the_quantized_model(arch: str, tmp_path) -> None:
    logits = make_checkpoint(arch, tmp_path)
    quantization = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert quantization["quant_method"] == "modelopt" and quantization["quant_algo"] == "FP8"
    llm = load(tmp_path)
    linears = fp8_linears(llm)
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    assert all(m.input_scale.item() > 0 for m in linears)  # static activations, as calibrated
    prompt_logprobs_match(llm, logits)


def test_fp8_per_channel_per_token(tmp_path) -> None:
    logits = make_checkpoint("llama", tmp_path, "FP8_PER_CHANNEL_PER_TOKEN")
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight_scale"].numel() == 64  # a scale per output row
    llm = load(tmp_path)
    assert all(not hasattr(m, "input_scale") for m in fp8_linears(llm))
    prompt_logprobs_match(llm, logits)


def as_hf_quant_config_only(path, **quantization) -> None:
    """A checkpoint's config.json without its quantization_config, as the older exports are (they say it
    only in hf_quant_config.json), with `quantization`'s fields changed in that file."""
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    beside = json.loads((path / "hf_quant_config.json").read_text())
    beside["quantization"].update(quantization)
    (path / "hf_quant_config.json").write_text(json.dumps(beside))


def test_hf_quant_config_beside_a_config_without_quantization_config(tmp_path) -> None:
    """The older exports (and many nvidia/*-FP8 models on the hub) say it only in hf_quant_config.json."""
    logits = make_checkpoint("llama", tmp_path)
    as_hf_quant_config_only(tmp_path)
    assert json.loads((tmp_path / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    prompt_logprobs_match(load(tmp_path), logits)
    prompt_logprobs_match(load(tmp_path, quantization="fp8"), logits)  # what vLLM users pass, taken too


def test_an_unsupported_algorithm_in_hf_quant_config_is_refused_by_its_field(tmp_path) -> None:
    """The older form names its own file and field in the refusal (the serve CLI's one-line error for it
    is a slow test of tests/entrypoints/test_quantized_serving.py)."""
    make_checkpoint("llama", tmp_path)
    as_hf_quant_config_only(tmp_path, quant_algo="NVFP4")
    with pytest.raises(ValueError, match=r"hf_quant_config.json quantization.quant_algo 'NVFP4' is not"):
        load(tmp_path)


def test_kv_cache_scales_are_read_and_used(tmp_path) -> None:
    logits = make_checkpoint("llama", tmp_path, kv=True)
    stored = load_file(str(tmp_path / "model.safetensors"))
    attention = "model.layers.{}.self_attn"
    want = [
        stored[f"{attention.format(i)}.{name}"].item()
        for i in range(2)
        for name in ("k_proj.k_scale", "v_proj.v_scale")
    ]
    llm = load(tmp_path, kv_cache_dtype="fp8")
    layers = llm.engine.runner.model.attention_layers()
    assert [scale for layer in layers for scale in (layer.k_scale, layer.v_scale)] == pytest.approx(want)
    assert all(scale != 1.0 for scale in want)
    # The library's model quantizes K and V at every attention; the engine's prompt attends over the
    # cache it wrote (this test's short prompt), so the two agree to the FP8 KV error.
    prompt_logprobs_match(llm, logits, atol=2e-2)


def test_excluded_modules_by_pattern_stay_in_the_model_dtype(tmp_path) -> None:
    """Model Optimizer writes its exclusions as names or patterns (layer 0's MLP here, left unquantized
    by a config entry as its own recipes do)."""
    disable = [{"quantizer_name": "*layers.0.mlp*", "enable": False}]
    logits = make_checkpoint("llama", tmp_path, extra=disable)
    quantization = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert any("layers.0.mlp" in entry for entry in quantization["ignore"])
    llm = load(tmp_path)
    dtypes = {
        name: m.weight.dtype
        for name, m in llm.engine.runner.model.named_modules()
        if isinstance(m, LinearBase)
    }
    assert dtypes["model.layers.0.mlp.gate_up_proj"] == torch.float32
    assert dtypes["model.layers.1.mlp.gate_up_proj"] == torch.float8_e4m3fn
    prompt_logprobs_match(llm, logits)


def test_moe_experts_stay_fp8(tmp_path) -> None:
    """Qwen3-MoE: Model Optimizer quantizes each expert's projections per tensor (the router it leaves);
    they load held in e4m3 with a scale a row. The experts run with activations in the model dtype
    (W8A16, as online fp8's), where the library's model quantizes their inputs too: a looser bound."""
    config = transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip
    logits = make_checkpoint("qwen3-moe", tmp_path, config=config)
    llm = load(tmp_path)
    moe = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.experts.w13.dtype == torch.float8_e4m3fn for m in moe)
    assert all(m.experts.w2.dtype == torch.float8_e4m3fn for m in moe)
    prompt_logprobs_match(llm, logits, atol=5e-3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quant_algo": "NVFP4"}, r"quantization_config.quant_algo 'NVFP4' is not supported"),
        ({"kv_cache_scheme": {"type": "int", "num_bits": 8}}, r"KV cache quantized as .* is not supported"),
        ({"ignore": "lm_head"}, r"quantization_config.ignore must be a list"),
    ],
)
def test_unsupported_variants_name_the_field(change: dict, message: str, tmp_path) -> None:
    make_checkpoint("llama", tmp_path)
    assert_config_change_refused(tmp_path, change, message)


def test_a_quantization_that_does_not_match_the_checkpoint_is_refused(tmp_path) -> None:
    make_checkpoint("llama", tmp_path)
    with pytest.raises(ValueError, match=r"quantization='gptq' does not match .* 'modelopt'"):
        load(tmp_path, quantization="gptq")
