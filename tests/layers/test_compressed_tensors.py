"""compressed-tensors FP8 and W4A16 checkpoints, made by the compressed-tensors library itself from
random models (weight scales from its own qparams, static input scales calibrated on a sample), loaded by
tokenmill and compared with the library's own fake-quantized forward: the same scheme, computed two ways."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.linear import LinearBase

from .quant_models import CONFIGS, PROMPT, load, prompt_logprobs_match, random_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

FP8 = dict(num_bits=8, type="float", symmetric=True)
INT4 = dict(num_bits=4, type="int")
INT8 = dict(num_bits=8, type="int", symmetric=True)
SCHEMES = {
    # format, weight args, input activations (None: weight-only)
    "fp8-channel-dynamic": ("float-quantized", dict(FP8, strategy="channel"), ("token", True)),
    "fp8-tensor-static": ("float-quantized", dict(FP8, strategy="tensor"), ("tensor", False)),
    "fp8-channel-weight-only": ("float-quantized", dict(FP8, strategy="channel"), None),
    # llm-compressor's FP8_BLOCK (blocks of 32 here, 128 in released models): activations per token and
    # per 32 input columns.
    "fp8-block": ("float-quantized", dict(FP8, strategy="block", block_structure=[32, 32]), ("group", True)),
    "int4-group-symmetric": (
        "pack-quantized",
        dict(INT4, strategy="group", group_size=32, symmetric=True),
        None,
    ),
    "int4-group-zero-points": (
        "pack-quantized",
        dict(INT4, strategy="group", group_size=32, symmetric=False),
        None,
    ),
    "int4-channel": ("pack-quantized", dict(INT4, strategy="channel", symmetric=True), None),
    "int4-channel-zero-points": ("pack-quantized", dict(INT4, strategy="channel", symmetric=False), None),
    # llm-compressor's W8A8 INT8 (its `int-quantized` format): int8 weights per channel or per tensor,
    # int8 activations per token (dynamic) or per tensor (static), symmetric; and int8 weight-only.
    "int8-channel-dynamic": ("int-quantized", dict(INT8, strategy="channel"), ("token", True, "int")),
    "int8-tensor-static": ("int-quantized", dict(INT8, strategy="tensor"), ("tensor", False, "int")),
    "int8-channel-weight-only": ("pack-quantized", dict(INT8, strategy="channel"), None),
}


def make_checkpoint(
    arch: str, scheme: str, path, ignore: tuple[str, ...] = (), head: bool = False
) -> torch.Tensor:
    """Quantize a random model with compressed-tensors (head: its LM head too), save it compressed;
    return the library's fake-quantized logits for PROMPT."""
    model = random_model(arch)
    fmt, weight_args, activations = SCHEMES[scheme]
    input_args = None
    if activations is not None:
        strategy, dynamic, kind = (*activations, "float")[:3]
        group = dict(group_size=weight_args["block_structure"][1]) if strategy == "group" else {}
        input_args = QuantizationArgs(
            num_bits=8, type=kind, strategy=strategy, symmetric=True, dynamic=dynamic, **group
        )
    weights = QuantizationArgs(**weight_args, dynamic=False)
    config = QuantizationConfig(
        config_groups={
            "group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=input_args)
        },
        ignore=[*([] if head else ["lm_head"]), *ignore],
        quantization_status=QuantizationStatus.INITIALIZED,
        format=fmt,
    )
    ids = torch.tensor([PROMPT])
    amax: dict[str, float] = {}
    hooks = [
        module.register_forward_pre_hook(
            lambda mod, args, name=name: amax.__setitem__(
                name, max(amax.get(name, 0.0), args[0].abs().max().item())
            )
        )
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    ]
    with torch.no_grad():
        model(ids)  # calibration pass for the static input scales
    for hook in hooks:
        hook.remove()
    apply_quantization_config(model, config)
    for name, module in model.named_modules():
        scheme_of = getattr(module, "quantization_scheme", None)
        if scheme_of is None:
            continue
        w = module.weight.data
        if weight_args["strategy"] == "group":  # one range per group of input columns
            w = w.reshape(w.shape[0], -1, weight_args["group_size"])
        if weight_args["strategy"] == "block":  # one range per block: [row blocks, column blocks, values]
            rows, columns = weight_args["block_structure"]
            w = w.reshape(w.shape[0] // rows, rows, -1, columns).transpose(1, 2).flatten(2)
        dims = dict(dim=-1) if weight_args["strategy"] != "tensor" else {}
        scale, zero = calculate_qparams(
            w.amin(**dims).reshape(-1), w.amax(**dims).reshape(-1), scheme_of.weights
        )
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        if activations is not None and activations[:2] == ("tensor", False):
            bound = torch.tensor([amax[name]])
            scale, zero = calculate_qparams(-bound, bound, scheme_of.input_activations)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
            module.input_zero_point.data.copy_(zero.reshape(module.input_zero_point.shape))
    with torch.no_grad():
        logits = model(ids).logits[0]
    ModelCompressor(quantization_config=config).compress_model(model)
    model.save_pretrained(path)
    ModelCompressor(quantization_config=config).update_config(str(path))
    return logits


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_logprobs_match_the_librarys_fake_quantized_forward(arch: str, scheme: str, tmp_path) -> None:
    logits = make_checkpoint(arch, scheme, tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert stored["quant_method"] == "compressed-tensors" and stored["format"] == SCHEMES[scheme][0]
    llm = load(tmp_path)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    # Held as stored: e4m3 or int8 `weight`, 4-bit `weight_packed` words (8-bit words unpacked to int8).
    held = {
        "fp8": ("weight", torch.float8_e4m3fn),
        "int8": ("weight", torch.int8),
        "int4": ("weight_packed", torch.int32),
    }
    name, dtype = held[scheme.split("-")[0]]
    assert linears and all(getattr(m, name).dtype == dtype for m in linears)
    prompt_logprobs_match(llm, logits)


def test_zero_points_of_rows_not_a_multiple_of_eight(tmp_path) -> None:
    """Zero points are packed eight output rows a word; where a layer's rows are not a multiple of 8 (an
    MLP 100 wide, KV heads 20 wide) the last word's padding is not a row of the layer."""
    logits = make_checkpoint("qwen3-ragged", "int4-channel-zero-points", tmp_path)
    prompt_logprobs_match(load(tmp_path), logits)


@pytest.mark.parametrize(
    "scheme",
    ["fp8-channel-dynamic", "int4-group-zero-points", "int8-tensor-static", "int8-channel-weight-only"],
)
def test_dummy_weights_in_a_checkpoints_quantized_layout(scheme: str, tmp_path) -> None:
    """load_format dummy on a quantized checkpoint's config: random weights in its layout (as a benchmark
    of a quantized shape runs), finite log-probabilities."""
    make_checkpoint("llama", scheme, tmp_path)
    llm = load(tmp_path, load_format="dummy")
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    held = (torch.float8_e4m3fn, torch.int32, torch.int8)
    assert any(p.dtype in held for m in linears for p in m.parameters())
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert all(math.isfinite(entry[t].logprob) for t, entry in zip(PROMPT[1:], out.prompt_logprobs[1:]))


def test_a_quantized_head_tied_to_the_embedding_is_said_and_runs_as_the_embedding(tmp_path, caplog) -> None:
    make_checkpoint("llama-tied", "fp8-channel-dynamic", tmp_path, head=True)
    assert any(name.startswith("lm_head.") for name in safetensors_names(tmp_path))
    llm = load(tmp_path)
    assert "quantized lm_head (lm_head.weight" in caplog.text
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def safetensors_names(path) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as stored:
            names += list(stored.keys())
    return names


def test_a_group_index_of_older_gptq_runs(tmp_path) -> None:
    """actorder "group" (llm-compressor's GPTQ before compressed-tensors 0.20 dropped it): each input
    column's group in weight_g_idx. The library's checkpoint is rewritten with its columns' groups in an
    order of their own (one order for the layers that read the same input), the reference being the
    same model holding those dequantized weights."""
    from safetensors.torch import load_file, save_file

    from tokenmill.kernels.quant_reference import pack_int4, unpack_int4

    make_checkpoint("llama", "int4-group-symmetric", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    model = random_model("llama")
    for name, module in model.named_modules():
        if f"{name}.weight_packed" not in tensors:
            continue
        n, k = module.weight.shape
        site = name.rsplit(".", 1)[0] + (".in" if name.endswith(("gate_proj", "up_proj")) else "")
        order = torch.randperm(k, generator=torch.Generator().manual_seed(sum(map(ord, site))))
        q = unpack_int4(tensors[f"{name}.weight_packed"], k)  # [N, K], column c in group c // 32
        scale = tensors[f"{name}.weight_scale"].float()
        moved = torch.empty_like(q)
        moved[:, order] = q  # column order[c] holds what column c held, and its group
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // 32
        tensors[f"{name}.weight_packed"] = pack_int4(moved)
        tensors[f"{name}.weight_g_idx"] = g_idx
        module.weight.data = moved.float() * scale[:, g_idx.long()]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    prompt_logprobs_match(load(tmp_path), logits)


def test_unsupported_schemes_name_the_field(tmp_path) -> None:
    make_checkpoint("llama", "fp8-channel-dynamic", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for path, value, message in [
        (("weights", "strategy"), "group", "weights.strategy 'group' is not supported"),
        (("weights", "num_bits"), 4, "weights.num_bits 4 is not supported"),
        (("input_activations", "dynamic"), False, "strategy 'token' with dynamic False"),
        (("weights", "strategy"), "block", "block_structure None must be"),
    ]:
        broken = json.loads(json.dumps(config))
        broken["quantization_config"]["config_groups"]["group_0"][path[0]][path[1]] = value
        (tmp_path / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            load(tmp_path)
    # What changes the linears' arithmetic beyond their quantization (compressed-tensors writes both
    # keys beside config_groups): online rotations, weights stored sparse. A dense sparsity_config (a
    # pruned model stored whole) loads.
    transform = {"config_groups": {"v": {"type": "hadamard", "apply": [{"targets": ["Linear"]}]}}}
    for key, value, message in [
        ("transform_config", transform, r"quantization_config.transform_config \(online rotations\) is not"),
        ("sparsity_config", {"format": "sparse-24-bitmask"}, "sparsity_config.format 'sparse-24-bitmask'"),
        ("sparsity_config", {"format": "dense", "global_sparsity": 0.5}, None),
    ]:
        (tmp_path / "config.json").write_text(
            json.dumps({**config, "quantization_config": {**config["quantization_config"], key: value}})
        )
        if message is None:
            load(tmp_path)
            continue
        with pytest.raises(ValueError, match=message):
            load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        LLM(str(tmp_path), skip_tokenizer_init=True, quantization="fp8", num_kv_blocks=16, max_model_len=64)


def test_unsupported_int8_schemes_name_the_field(tmp_path) -> None:
    make_checkpoint("llama", "int8-channel-dynamic", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    int8_activations = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
    for changes, message in [
        ({("weights", "strategy"): "group"}, "weights.strategy 'group' is not supported"),
        ({("weights", "symmetric"): False}, "weights.symmetric False is not supported"),
        ({("input_activations", "symmetric"): False}, "input_activations.symmetric False is not supported"),
        ({("input_activations", "type"): "float"}, "input_activations.type 'float' is not supported"),
        ({("input_activations", "dynamic"): False}, "strategy 'token' with dynamic False"),
        # 8-bit packed words are weight-only (as llm-compressor writes W8A16).
        ({("format",): "pack-quantized"}, "packed 8-bit weights run W8A16; activations must be null"),
    ]:
        broken = json.loads(json.dumps(config))
        group = broken["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = dict(int8_activations)
        for path, value in changes.items():
            if path == ("format",):
                broken["quantization_config"]["format"] = value
            else:
                group[path[0]][path[1]] = value
        (tmp_path / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            load(tmp_path)


def test_ignored_layers_stay_unquantized(tmp_path) -> None:
    # Fused layers are ignored through their parts' names, exact or `re:` patterns.
    ignore = ("model.layers.1.mlp.down_proj", "re:.*layers.0.self_attn.[qkv]_proj")
    logits = make_checkpoint("llama", "fp8-channel-dynamic", tmp_path, ignore)
    llm = load(tmp_path)
    dtypes = {
        n: m.weight.dtype for n, m in llm.engine.runner.model.named_modules() if isinstance(m, LinearBase)
    }
    assert dtypes.pop("model.layers.1.mlp.down_proj") == torch.float32
    assert dtypes.pop("model.layers.0.self_attn.qkv_proj") == torch.float32
    assert set(dtypes.values()) == {torch.float8_e4m3fn}
    prompt_logprobs_match(llm, logits)


def test_an_ignore_list_naming_some_parts_of_a_fused_layer_names_the_field(tmp_path) -> None:
    make_checkpoint("llama", "fp8-channel-dynamic", tmp_path, ("re:.*layers.0.mlp.gate_proj",))
    with pytest.raises(ValueError, match=r"quantization_config.ignore leaves .*gate_proj.* not .*up_proj"):
        load(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "scheme",
    [
        "fp8-channel-dynamic", "fp8-tensor-static", "int4-group-zero-points", "int8-tensor-static",
        "int8-channel-weight-only",
    ],
)  # fmt: skip
def test_on_gpu_in_bf16_with_its_kernels(scheme: str, tmp_path) -> None:
    # The prompt's 12 rows take the skinny kernels (FP8 and INT8 weights W8A16, the 4-bit GEMV); bf16
    # rounding on top of the scheme's own.
    if scheme.startswith("fp8") and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    logits = make_checkpoint("qwen3", scheme, tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=16, max_model_len=64)
    prompt_logprobs_match(llm, logits, atol=5e-2)


def test_a_scale_of_the_wrong_shape_names_the_tensor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    make_checkpoint("llama", "fp8-channel-dynamic", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = torch.cat([tensors[name], tensors[name]])  # twice the rows
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}': shape"):
        load(tmp_path)
