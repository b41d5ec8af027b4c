"""Fine-grained FP8 checkpoints (`quant_method: fp8` with weight_block_size, as DeepSeek-V3 and Qwen3-FP8
ship), written from the published layout (e4m3 `weight`, fp32 `weight_scale_inv` per block) and compared
with the same model computing the scheme itself: dequantized weights, activations quantized per token
and per block of input columns at every linear's input. Also `quant_method: fp8` without blocks, as AutoFP8
wrote it: one scale per tensor, activations dynamic or static."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from tokenmill.layers.linear import LinearBase

from .quant_models import (
    ARCHITECTURES,
    CONFIGS,
    PROMPT,
    assert_config_change_refused,
    load,
    model_config,
    prompt_logprobs_match,
    random_model,
)

BLOCK = 32  # the checkpoints' weight_block_size is [BLOCK, BLOCK] (128 in released models)


def fake_quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """Each token's columns in groups of BLOCK, rounded through e4m3 at amax / 448."""
    *lead, k = x.shape
    groups = math.ceil(k / BLOCK)
    padded = torch.nn.functional.pad(x.reshape(-1, k), (0, groups * BLOCK - k)).reshape(-1, groups, BLOCK)
    scale = padded.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    q = (padded / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return q.reshape(-1, groups * BLOCK)[:, :k].reshape(*lead, k)


def make_checkpoint(arch: str, path) -> torch.Tensor:
    model = random_model(arch)
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        w = module.weight.data
        n, k = w.shape
        rows, cols = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
        padded = torch.nn.functional.pad(w, (0, cols * BLOCK - k, 0, rows * BLOCK - n))
        blocks = padded.reshape(rows, BLOCK, cols, BLOCK)
        scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
        q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
        dequantized = (q.float() * scale_inv[:, None, :, None]).reshape(rows * BLOCK, cols * BLOCK)[:n, :k]
        module.weight.data = dequantized
        module.register_forward_pre_hook(lambda mod, args: (fake_quantize_tokens(args[0]),))
        tensors[f"{name}.weight"] = q.reshape(rows * BLOCK, cols * BLOCK)[:n, :k].contiguous()
        tensors[f"{name}.weight_scale_inv"] = scale_inv
    for name, param in model.named_parameters():
        tensors.setdefault(name, param.data.contiguous())
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    save_file(tensors, str(path / "model.safetensors"))
    config = model_config(arch).to_dict()
    config["architectures"] = [ARCHITECTURES[arch]]
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return logits


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_logprobs_match_the_scheme_computed_by_the_model_itself(arch: str, tmp_path) -> None:
    logits = make_checkpoint(arch, tmp_path)
    llm = load(tmp_path)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    prompt_logprobs_match(llm, logits)


def test_fused_parts_that_are_not_whole_blocks(tmp_path) -> None:
    """One KV head of 20 rows and an MLP 100 wide against blocks of 32: each part keeps its own scale
    blocks, held in finer blocks of the fused layer (here 4 rows: gcd(32, 80, 20))."""
    logits = make_checkpoint("qwen3-ragged", tmp_path)
    llm = load(tmp_path)
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.fp8_block_n == 4
    prompt_logprobs_match(llm, logits)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"activation_scheme": "static"}, "activation_scheme 'static' is not supported with weight_block"),
        ({"weight_block_size": [128]}, r"weight_block_size \[128\] is not supported"),
        ({"fmt": "e5m2"}, "fmt 'e5m2'"),
    ],
)
def test_unsupported_variants_name_the_field(change: dict, message: str, tmp_path) -> None:
    make_checkpoint("llama", tmp_path)
    assert_config_change_refused(tmp_path, change, message)


@pytest.mark.parametrize(
    ("tensor", "dtype", "kind"),
    [("weight", torch.bfloat16, "float8_e4m3fn"), ("weight_scale_inv", torch.int32, "floating-point")],
)
def test_a_tensor_of_the_wrong_kind_of_dtype_names_itself(tensor, dtype, kind, tmp_path) -> None:
    """A weight dequantized to bf16 beside its scales (or an e5m2 one) would be cast to e4m3 and scaled
    again: nonsense, so it is refused by name."""
    from safetensors.torch import load_file

    make_checkpoint("llama", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = f"model.layers.0.mlp.up_proj.{tensor}"
    tensors[name] = tensors[name].float().to(dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}': dtype .* is not the expected {kind} dtype"):
        load(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_gpu_in_bf16(tmp_path) -> None:
    logits = make_checkpoint("qwen3", tmp_path)
    prompt_logprobs_match(load(tmp_path, dtype="bfloat16"), logits, atol=5e-2)


def make_per_tensor_checkpoint(arch: str, path, static: bool) -> torch.Tensor:
    """AutoFP8's layout (`quant_method: fp8`, no weight_block_size): e4m3 weights with one scale per
    tensor; activations per token (dynamic) or through a calibrated per-tensor `input_scale` (static, the
    same for layers that read the same input, as calibration gives them). Returns the logits of the model
    computing that scheme itself."""
    model = random_model(arch)
    tensors, amax = {}, {}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}

    def site(name: str) -> str:  # the layers reading one input (q/k/v; gate/up) share its range
        parent, leaf = name.rsplit(".", 1)
        return parent if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else name

    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, s=site(n): amax.__setitem__(
                s, max(amax.get(s, 0.0), args[0].abs().max().item())
            )
        )
        for n, m in linears.items()
    ]
    with torch.no_grad():
        model(torch.tensor([PROMPT]))
    for hook in hooks:
        hook.remove()
    for name, module in linears.items():
        w = module.weight.data
        scale = w.abs().max() / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        module.weight.data = q.float() * scale
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = q, scale.reshape(())
        if static:
            input_scale = torch.tensor(amax[site(name)] / 448)
            tensors[f"{name}.input_scale"] = input_scale
            # Saturating at e4m3's largest value, as the engine does (torch before 2.13 makes NaN past it).
            hook = lambda mod, args, s=input_scale: (  # noqa: E731
                (args[0] / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,
            )
        else:
            hook = lambda mod, args: (fake_quantize_rows(args[0]),)  # noqa: E731
        module.register_forward_pre_hook(hook)
    for name, param in model.named_parameters():
        tensors.setdefault(name, param.data.contiguous())
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    save_file(tensors, str(path / "model.safetensors"))
    config = model_config(arch).to_dict()
    config["architectures"] = [ARCHITECTURES[arch]]
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
        "ignored_layers": ["lm_head"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return logits


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_per_tensor_fp8_checkpoints_as_autofp8_wrote_them(arch: str, static: bool, tmp_path) -> None:
    """No weight_block_size: one weight scale per tensor (q, k and v each their own, spread over their
    rows), activations per token or per tensor. It had been refused as 'weight_block_size None'."""
    logits = make_per_tensor_checkpoint(arch, tmp_path, static)
    llm = load(tmp_path)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
    prompt_logprobs_match(llm, logits)


def test_ignored_layers_naming_some_parts_of_a_fused_layer_names_that_field(tmp_path) -> None:
    make_per_tensor_checkpoint("llama", tmp_path, static=False)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["lm_head", "model.layers.0.self_attn.q_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"quantization_config.ignored_layers leaves .*q_proj.* not .*k_proj"
    ):
        load(tmp_path)
