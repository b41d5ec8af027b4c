"""Quantized checkpoints of mixture-of-experts models (Qwen3-MoE, Mixtral) whose experts are quantized
too, the router left out as llm-compressor and GPTQModel leave it: compressed-tensors tensors made by the
compressed-tensors library on modules named as the checkpoint names them, GPTQ, AWQ and fine-grained FP8
written from their published layouts. The experts stay quantized as they load (quantization/moe_experts.py),
unless the checkpoint stored them dense; the reference is transformers' model holding every dequantized
weight."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tokenmill.bench.quant_checkpoints import pack_bytes, pack_columns, pack_gptq_rows
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.quantization.gptq_awq import AWQ_ORDER

from .quant_models import PROMPT, load, prompt_logprobs_match

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

CONFIGS = {
    "qwen3-moe": transformers.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "mixtral": transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
}  # fmt: skip
GROUP = 16  # divides every input width above (64, 48, 96)
ROUTER = ("mlp.gate.weight", "block_sparse_moe.gate.weight")


def quantized_names(tensors: dict[str, torch.Tensor], scheme: str) -> list[str]:
    """The linears `scheme` quantizes: every one but the router's (ct-w4a16-router: the router's too); the
    experts' only (fp8-block-experts, autofp8-experts); none of the experts' (gptq-dense-experts: a
    checkpoint that leaves them out without listing them)."""
    return [
        name for name, t in tensors.items()
        if t.dim() == 2 and name.startswith("model.layers.") and not name.endswith(ROUTER)
        and (".experts." in name or scheme not in ("fp8-block-experts", "autofp8-experts"))
        and (".experts." not in name or scheme != "gptq-dense-experts")
    ] + [name for name in tensors if name.endswith(ROUTER) and scheme == "ct-w4a16-router"]  # fmt: skip


def gptq_awq(tensors: dict, names: list[str], method: str, bits: int = 4) -> dict[str, torch.Tensor]:
    """Asymmetric round-to-nearest groups of GROUP input rows: returns the layout's tensors and puts the
    dequantized weights back into `tensors` (the reference's). bits 8: GPTQ's 8-bit layout."""
    stored, top = {}, (1 << bits) - 1
    for name in names:
        w = tensors[name].float()
        base, (n, k) = name[: -len(".weight")], w.shape
        groups = w.t().reshape(k // GROUP, GROUP, n)
        lo, hi = groups.amin(1), groups.amax(1)
        scale = ((hi - lo) / top).clamp(min=1e-8).half()
        zero = torch.round(-lo / scale.float()).clamp(1, top)  # GPTQ stores zero - 1: keep zero >= 1
        q = torch.round(groups / scale.float()[:, None] + zero[:, None]).clamp(0, top)
        tensors[name] = ((q - zero[:, None]) * scale.float()[:, None]).reshape(k, n).t().contiguous()
        q = q.reshape(k, n)
        if method == "gptq" and bits == 8:
            stored[f"{base}.qweight"] = pack_bytes(q.t()).t().contiguous()
            stored[f"{base}.qzeros"] = pack_bytes(zero - 1)
            stored[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
        elif method == "gptq":
            stored[f"{base}.qweight"] = pack_gptq_rows(q)
            stored[f"{base}.qzeros"] = pack_columns(zero - 1)
            stored[f"{base}.g_idx"] = torch.arange(k, dtype=torch.int32) // GROUP
        else:
            stored[f"{base}.qweight"] = pack_columns(q, AWQ_ORDER)
            stored[f"{base}.qzeros"] = pack_columns(zero, AWQ_ORDER)
        stored[f"{base}.scales"] = scale
    return stored


def fp8_block(tensors: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """e4m3 weights with one scale per GROUP x GROUP block, as gptq_awq."""
    stored = {}
    for name in names:
        w = tensors[name].float()
        (n, k), rows, cols = w.shape, math.ceil(w.shape[0] / GROUP), math.ceil(w.shape[1] / GROUP)
        blocks = torch.nn.functional.pad(w, (0, cols * GROUP - k, 0, rows * GROUP - n))
        blocks = blocks.reshape(rows, GROUP, cols, GROUP)
        scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
        q = (blocks / scale_inv[:, None, :, None]).to(torch.float8_e4m3fn)
        tensors[name] = (
            (q.float() * scale_inv[:, None, :, None]).reshape(rows * GROUP, -1)[:n, :k].contiguous()
        )
        stored[name] = q.reshape(rows * GROUP, -1)[:n, :k].contiguous()
        stored[f"{name}_scale_inv"] = scale_inv
    return stored


def fp8_per_tensor(tensors: dict, names: list[str]) -> dict[str, torch.Tensor]:
    """AutoFP8's layout: e4m3 weights with one scale per tensor, as gptq_awq."""
    stored = {}
    for name in names:
        w = tensors[name].float()
        scale = w.abs().amax().clamp(min=1e-12) / 448
        q = (w / scale).to(torch.float8_e4m3fn)
        tensors[name] = q.float() * scale
        stored[name], stored[f"{name[: -len('.weight')]}.weight_scale"] = q, scale.reshape(())
    return stored


def compressed(
    tensors: dict, names: list[str], weights: QuantizationArgs, fmt: str, router: bool = False
) -> tuple[dict, dict]:
    """The library's compressed tensors of `names`, from nn.Linear modules named as the checkpoint names
    them (its qparams from each row's or group's range; router: the routers too, not in the ignore
    list); the dequantized weights go back into `tensors`. Returns (compressed tensors,
    quantization_config)."""
    root = torch.nn.Module()
    for name in names:
        *path, leaf = name[: -len(".weight")].split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        n, k = tensors[name].shape
        parent.add_module(leaf, torch.nn.Linear(k, n, bias=False))
        getattr(parent, leaf).weight.data = tensors[name].float().clone()
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"] + ([] if router else ["re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"]),
        quantization_status=QuantizationStatus.INITIALIZED,
        format=fmt,
    )
    apply_quantization_config(root, config)
    for name in names:
        module = root.get_submodule(name[: -len(".weight")])
        w = module.weight.data
        ranges = w.reshape(w.shape[0], -1, weights.group_size) if weights.group_size else w
        scale, zero = calculate_qparams(ranges.amin(-1).reshape(-1), ranges.amax(-1).reshape(-1), weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        tensors[name] = fake_quantize(w, module.weight_scale, module.weight_zero_point, weights)
    ModelCompressor(quantization_config=config).compress_model(root)
    return dict(root.state_dict()), ModelCompressor(
        quantization_config=config
    ).quantization_config.model_dump()


SCHEMES = (
    "gptq",
    "awq",
    "ct-w4a16-zero-points",
    "ct-fp8-weight-only",
    "fp8-block-experts",
    "autofp8-experts",
    "gptq-dense-experts",
    "ct-w4a16-router",
    "ct-int8-weight-only",
    "gptq-8bit",
)


def make_checkpoint(arch: str, scheme: str, path) -> torch.Tensor:
    """Save `arch` with its linears quantized in `scheme` (fp8-block-experts: the experts only, attention
    in modules_to_not_convert); returns the logits of transformers' model holding the dequantized weights."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch], dtype=torch.float32).eval()
    model.save_pretrained(path)
    model.save_pretrained(path / "reference")
    tensors = load_file(str(path / "reference" / "model.safetensors"))
    names = quantized_names(tensors, scheme)
    if scheme in ("gptq", "awq", "gptq-dense-experts", "gptq-8bit"):
        method, bits = scheme[:4], 8 if scheme == "gptq-8bit" else 4
        quantized = gptq_awq(tensors, names, method, bits)
        quantization = {"quant_method": method, "bits": bits, "group_size": GROUP}
        quantization.update({"desc_act": False, "sym": False} if method == "gptq" else {"version": "gemm"})
    elif scheme == "autofp8-experts":
        quantized = fp8_per_tensor(tensors, names)
        quantization = {
            "quant_method": "fp8", "activation_scheme": "dynamic",
            "ignored_layers": ["lm_head", "self_attn", "mlp.gate", "block_sparse_moe.gate"],
        }  # fmt: skip
    elif scheme == "fp8-block-experts":
        quantized = fp8_block(tensors, names)
        quantization = {
            "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [GROUP, GROUP],
            "modules_to_not_convert": ["self_attn"],
        }  # fmt: skip
    else:
        weights = (
            QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=GROUP, symmetric=False)
            if scheme in ("ct-w4a16-zero-points", "ct-w4a16-router")
            else QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
            if scheme == "ct-int8-weight-only"
            else QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
        )
        fmt = "float-quantized" if scheme == "ct-fp8-weight-only" else "pack-quantized"
        quantized, quantization = compressed(tensors, names, weights, fmt, scheme == "ct-w4a16-router")
        quantization["quant_method"] = "compressed-tensors"
    save_file(
        {n: t for n, t in tensors.items() if n not in names} | quantized, str(path / "model.safetensors")
    )
    config = json.loads((path / "reference" / "config.json").read_text())
    config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "reference" / "model.safetensors"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(path / "reference", dtype=torch.float32)
    with torch.no_grad():
        return reference.eval()(torch.tensor([PROMPT])).logits[0]


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_experts_match_the_dequantized_model(arch: str, scheme: str, tmp_path) -> None:
    logits = make_checkpoint(arch, scheme, tmp_path)
    # On CUDA where there is one: the experts' kernels are weight-only, the reference's arithmetic too.
    llm = load(tmp_path, device="auto")
    assert any(isinstance(m, FusedMoE) for m in llm.engine.runner.model.modules())
    assert_experts_held(llm, arch, scheme)
    prompt_logprobs_match(llm, logits)


# How each scheme's experts are held: (w13's dtype, its bytes per weight, zero points).
HELD = {
    "gptq": (torch.int32, 0.5, True),
    "awq": (torch.int32, 0.5, True),
    "ct-w4a16-zero-points": (torch.int32, 0.5, True),
    "ct-w4a16-router": (torch.int32, 0.5, True),
    "ct-fp8-weight-only": (torch.float8_e4m3fn, 1, False),
    "fp8-block-experts": (torch.float8_e4m3fn, 1, False),
    "autofp8-experts": (torch.float8_e4m3fn, 1, False),
    "gptq-dense-experts": (torch.float32, 4, False),
    "ct-int8-weight-only": (torch.int8, 1, False),
    "gptq-8bit": (torch.int8, 1, True),
}


def assert_experts_held(llm, arch: str, scheme: str) -> None:
    """The experts stay quantized (a byte or half a byte a weight), with a scale per row and group of
    GROUP columns (per row for channel-wise FP8); a checkpoint that stored them dense holds them dense."""
    config = CONFIGS[arch]
    hidden = config.hidden_size
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    dtype, per_weight, zero_points = HELD[scheme]
    for module in llm.engine.runner.model.modules():
        if not isinstance(module, FusedMoE):
            continue
        held = module.experts
        assert held.w13.dtype == dtype and held.w2.dtype == dtype
        assert held.w13.nbytes + held.w2.nbytes == experts * 3 * inter * hidden * per_weight
        if scheme == "gptq-dense-experts":
            assert held.fmt is None and not hasattr(held, "w13_scale")
            continue
        groups = (
            1
            if scheme in ("ct-fp8-weight-only", "autofp8-experts", "ct-int8-weight-only")
            else hidden // GROUP
        )
        assert tuple(held.w13_scale.shape) == (experts, 2 * inter, groups)
        assert hasattr(held, "w13_zero") == zero_points


def test_an_expert_missing_a_tensor_names_it(tmp_path) -> None:
    make_checkpoint("qwen3-moe", "gptq", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.2.down_proj.scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing quantized expert tensors .*experts\.2\.down_proj\.scales"):
        load(tmp_path)


def test_an_expert_scale_of_the_wrong_shape_names_the_tensor(tmp_path) -> None:
    make_checkpoint("mixtral", "ct-fp8-weight-only", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight_scale"
    tensors[name] = torch.cat([tensors[name], tensors[name]])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"checkpoint tensor '{name}': shape"):
        load(tmp_path)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_online_fp8_quantizes_the_experts(arch: str, tmp_path) -> None:
    """`quantization="fp8"` on a dense MoE checkpoint puts the experts in e4m3 too (one scale per row,
    as vLLM's Fp8MoEMethod quantizes them online); the model stays close to the dense one."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch], dtype=torch.float32).eval()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    llm = load(tmp_path, quantization="fp8")
    config = CONFIGS[arch]
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    layers = [m.experts for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == config.num_hidden_layers
    for held in layers:
        assert held.w13.dtype == held.w2.dtype == torch.float8_e4m3fn
        assert held.w13.nbytes + held.w2.nbytes == experts * 3 * inter * config.hidden_size
        assert tuple(held.w2_scale.shape) == (experts, config.hidden_size, 1)
    prompt_logprobs_match(llm, logits, atol=5e-2)  # (FP8 everywhere: the linears W8A8 too)


def test_experts_of_a_scheme_without_a_kernel_are_dequantized_with_a_warning(tmp_path, caplog) -> None:
    """GPTQ desc_act (each expert's input columns in an order of its own, which the kernel does not
    take): the experts load dense, as before, said once."""
    logits = make_checkpoint("qwen3-moe", "gptq", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING"):
        llm = load(tmp_path)
    assert "were dequantized as they loaded" in caplog.text
    for module in llm.engine.runner.model.modules():
        if isinstance(module, FusedMoE):
            assert module.experts.fmt is None and module.experts.w13.dtype == torch.float32
    prompt_logprobs_match(llm, logits)


@pytest.mark.parametrize("scheme", ["gptq", "fp8-block-experts", "ct-int8-weight-only", "gptq-8bit"])
def test_dummy_weights_fill_quantized_experts(scheme: str, tmp_path) -> None:
    """load_format dummy on a quantized MoE checkpoint's config: the experts' quantized values are random
    and their scales (buffers, beside them) set, so a benchmark's experts are not all zero."""
    make_checkpoint("qwen3-moe", scheme, tmp_path)
    llm = load(tmp_path, load_format="dummy")
    for module in llm.engine.runner.model.modules():
        if isinstance(module, FusedMoE):
            held = module.experts
            assert held.fmt is not None and held.w13.float().abs().sum() > 0
            want = 0.004 if held.fmt.int4 else 0.02 / 74 if held.fmt.int8 else 0.02  # (about N(0, 0.02))
            assert torch.allclose(held.w13_scale, torch.full_like(held.w13_scale, want))
            if held.fmt.int8:  # int8 values over their whole range
                assert held.w13.min() < -64
