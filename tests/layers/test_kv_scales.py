"""FP8 KV cache scales from the checkpoint: a compressed-tensors `kv_cache_scheme` checkpoint made by the
compressed-tensors library (its own k_scale / v_scale parameters, set from the keys and values the model
actually stores), loaded with kv_cache_dtype='fp8'. The model's keys and values are made small, where
e4m3 with a scale of 1.0 loses most of their bits: the checkpoint's scales must bring the log-probabilities
back near the unquantized cache's, and a bf16/fp32 cache must ignore them."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import SamplingParams

from .quant_models import PROMPT, load, random_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStatus,
    apply_quantization_config,
)

KV_SCHEME = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)


def small_kv_model(arch: str):
    """A random model whose keys and values are ~1e-3 (K and V projections scaled down)."""
    model = random_model(arch)
    for layer in model.model.layers:
        layer.self_attn.k_proj.weight.data *= 0.01
        layer.self_attn.v_proj.weight.data *= 0.01
    return model


def stored_kv_amax(model) -> list[tuple[float, float]]:
    """The largest |K| and |V| each layer stores for PROMPT (keys after rotary, as the cache holds them)."""
    with torch.no_grad():
        cache = model(torch.tensor([PROMPT]), use_cache=True).past_key_values
    layers = getattr(cache, "layers", None)  # transformers >= 4.56; before, key_cache and value_cache
    if layers is not None:
        pairs = [(x.keys, x.values) for x in layers]
    else:
        pairs = list(zip(cache.key_cache, cache.value_cache))
    return [(float(k.abs().max()), float(v.abs().max())) for k, v in pairs]


def save_with_kv_scheme(model, path) -> list[tuple[float, float]]:
    """Save `model` with a KV-only compressed-tensors config and per-layer scales amax / 448; returns them."""
    scales = [(k / 448, v / 448) for k, v in stored_kv_amax(model)]
    config = QuantizationConfig(
        config_groups={},
        kv_cache_scheme=QuantizationArgs(**KV_SCHEME),
        quantization_status=QuantizationStatus.FROZEN,
    )
    apply_quantization_config(model, config)
    for layer, (k_scale, v_scale) in zip(model.model.layers, scales):
        layer.self_attn.k_scale.data.fill_(k_scale)
        layer.self_attn.v_scale.data.fill_(v_scale)
    model.save_pretrained(path)
    ModelCompressor(quantization_config=config).update_config(str(path))
    return scales


def prompt_logprobs(llm) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    return torch.tensor([entry[t].logprob for t, entry in zip(PROMPT[1:], out.prompt_logprobs[1:])])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fp8_kv_cache_takes_the_checkpoints_scales(arch: str, tmp_path) -> None:
    plain, with_scales = tmp_path / "plain", tmp_path / "kv-scales"
    small_kv_model(arch).save_pretrained(plain)
    scales = save_with_kv_scheme(small_kv_model(arch), with_scales)
    config = json.loads((with_scales / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["strategy"] == "tensor"

    exact = prompt_logprobs(load(plain))
    unscaled = load(plain, kv_cache_dtype="fp8")
    scaled = load(with_scales, kv_cache_dtype="fp8")
    layers = scaled.engine.runner.model.attention_layers()
    got = [s for a in layers for s in (a.k_scale, a.v_scale)]
    assert got == pytest.approx([s for pair in scales for s in pair], rel=1e-2)
    assert all(a.k_scale == a.v_scale == 1.0 for a in unscaled.engine.runner.model.attention_layers())
    error_unscaled = (prompt_logprobs(unscaled) - exact).abs().max()
    error_scaled = (prompt_logprobs(scaled) - exact).abs().max()
    assert error_scaled < 0.2 * error_unscaled
    # A bf16/fp32 cache leaves the scales aside and computes what the plain checkpoint does.
    unquantized = load(with_scales)
    assert all(a.k_scale == 1.0 for a in unquantized.engine.runner.model.attention_layers())
    torch.testing.assert_close(prompt_logprobs(unquantized), exact)


def test_bad_kv_schemes_and_scales_are_clear_errors(tmp_path) -> None:
    path = tmp_path / "kv"
    save_with_kv_scheme(small_kv_model("llama"), path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"kv_cache_scheme\.strategy 'channel' is not supported"):
        load(path, kv_cache_dtype="fp8")
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "tensor"
    config_file.write_text(json.dumps(config))

    from safetensors.torch import load_file, save_file

    weights_file = path / "model.safetensors"
    tensors = load_file(weights_file)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([0.1, 0.2])
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.v_scale' has 2 values"):
        load(path, kv_cache_dtype="fp8")
    del tensors["model.layers.1.self_attn.v_scale"]
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match="only one of layer 1's k_scale and v_scale"):
        load(path, kv_cache_dtype="fp8")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_dense_prefill_attends_over_what_an_fp8_cache_stored(arch: str, tmp_path) -> None:
    """A CUDA step holding one whole prompt attends densely over the step's keys and values; under an FP8
    cache it must see them as the cache holds them (rounded to e4m3 under the scales), as a prompt batched
    with another reads them through the paged kernels: the same log-probabilities either way (it had seen
    them unrounded, 0.25 apart on a random model)."""
    path = tmp_path / "kv-scales"
    save_with_kv_scheme(small_kv_model(arch), path)
    other = [5, 9, 14, 2, 77, 31, 8]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)

    def logprobs(llm, prompts) -> torch.Tensor:
        out = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)[0]
        return torch.tensor([entry[t].logprob for t, entry in zip(PROMPT[1:], out.prompt_logprobs[1:])])

    llm = load(path, kv_cache_dtype="fp8", enable_prefix_caching=False)
    llm.engine.runner.dense_prefill_ok = True  # what a CUDA runner takes (the CPU's SDPA runs it)
    alone, batched = logprobs(llm, [PROMPT]), logprobs(llm, [PROMPT, other])
    exact = logprobs(load(path, enable_prefix_caching=False), [PROMPT])
    torch.testing.assert_close(alone, batched, atol=1e-4, rtol=0)
    assert (alone - exact).abs().max() > 1e-4  # the rounding is there to see
