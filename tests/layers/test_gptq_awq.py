"""GPTQ and AWQ 4-bit checkpoints written from their published layouts (the packers of
tokenmill/bench/quant_checkpoints.py follow the formats' specs; the libraries themselves need CUDA builds
this machine lacks), loaded by tokenmill and compared with the same model holding the dequantized
weights."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tokenmill.bench.quant_checkpoints import pack_bytes, pack_columns, pack_gptq_rows
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.quantization.gptq_awq import AWQ_ORDER

from .quant_models import (
    ARCHITECTURES,
    AWKWARD_CONFIGS,
    CONFIGS,
    PROMPT,
    load,
    prompt_logprobs_match,
    random_model,
)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def make_checkpoint(
    arch: str,
    method: str,
    group: int,
    path,
    skip: tuple[str, ...] = (),
    act_order: bool = False,
    sym: bool = False,
    bits: int = 4,
) -> torch.Tensor:
    """Quantize a random model's linears (round-to-nearest, asymmetric groups, or symmetric ones with
    zero 8 as GPTQ's sym stores them; not those named in `skip`, listed in modules_to_not_convert), save
    the GPTQ or AWQ tensors; returns the logits of the model with the dequantized weights. group -1 is
    one group per column; where group does not divide a layer's input rows the last group is short, as
    AutoGPTQ stores it. act_order (GPTQ's desc_act): each layer's input rows grouped in an order of their
    own (one order for the layers that read the same input: q/k/v, gate/up), its g_idx saying which
    group each row is in. bits 8 (GPTQ only): values 0..255, four to a word, packed the same ways."""
    top = (1 << bits) - 1  # 15 or 255
    model = random_model(arch)
    tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head" or name in skip:
            continue
        w = module.weight.data  # [N, K]
        n, k = w.shape
        site = name.rsplit(".", 1)[0] + (".mlp_in" if name.endswith(("gate_proj", "up_proj")) else "")
        seed = sum(map(ord, site)) if act_order else None  # the layers of one input share an order
        order = (
            torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
        )
        rows = group if group > 0 else k
        num_groups = -(-k // rows)
        # [G, rows, N] in quantization order; a short last group repeats its last row (same range).
        groups = w.t()[order][torch.arange(num_groups * rows).clamp(max=k - 1)].reshape(num_groups, rows, n)
        lo, hi = groups.amin(1), groups.amax(1)
        if sym:
            scale = (torch.maximum(-lo, hi) / (top / 2)).clamp(min=1e-8).half()
            zero = torch.full_like(lo, (top + 1) / 2)
        else:
            scale = ((hi - lo) / top).clamp(min=1e-8).half()
            zero = torch.round(-lo / scale.float()).clamp(1, top)  # GPTQ stores zero - 1: keep zero >= 1
        q = torch.round(groups / scale.float()[:, None] + zero[:, None]).clamp(0, top)  # [G, rows, N]
        q = q.reshape(-1, n)[:k]
        in_group = torch.arange(k) // rows
        dequantized = torch.empty(k, n)
        dequantized[order] = (q - zero[in_group]) * scale.float()[in_group]
        module.weight.data = dequantized.t().contiguous()
        q_rows = torch.empty(k, n)
        q_rows[order] = q
        q = q_rows
        if method == "gptq":
            g_idx = torch.empty(k, dtype=torch.int32)
            g_idx[order] = in_group.to(torch.int32)
            qweight = pack_gptq_rows(q) if bits == 4 else pack_bytes(q.t()).t().contiguous()
            tensors[f"{name}.qweight"] = qweight
            tensors[f"{name}.qzeros"] = pack_columns(zero - 1) if bits == 4 else pack_bytes(zero - 1)
            tensors[f"{name}.g_idx"] = g_idx
        else:
            tensors[f"{name}.qweight"] = pack_columns(q, AWQ_ORDER)
            tensors[f"{name}.qzeros"] = pack_columns(zero, AWQ_ORDER)
        tensors[f"{name}.scales"] = scale
    quantized = {n.rsplit(".", 1)[0] + ".weight" for n in tensors}
    for name, param in model.named_parameters():
        if name not in quantized:  # a quantized layer's bias (Qwen2's q/k/v) is stored as it is
            tensors[name] = param.data.contiguous()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    save_file(tensors, str(path / "model.safetensors"))
    config = CONFIGS[arch].to_dict()
    quantization = {"quant_method": method, "bits": bits, "group_size": group}
    quantization.update(
        {"desc_act": act_order, "sym": sym} if method == "gptq" else {"zero_point": True, "version": "gemm"}
    )
    if skip:
        quantization["modules_to_not_convert"] = list(skip)
    config["quantization_config"] = quantization
    config["architectures"] = [ARCHITECTURES[arch]]
    (path / "config.json").write_text(json.dumps(config))
    return logits


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_logprobs_match_the_dequantized_model(arch: str, method: str, tmp_path) -> None:
    logits = make_checkpoint(arch, method, 32, tmp_path)
    # Detected from the checkpoint; vLLM's `--quantization gptq_marlin` / `awq_marlin` are taken too.
    llm = load(tmp_path, quantization=f"{method}_marlin" if arch == "llama" else None)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.qweight.dtype == torch.int32 for m in linears)
    prompt_logprobs_match(llm, logits)


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize("sym", [False, True])
def test_gptq_8_bit_checkpoints_match_the_dequantized_model(arch: str, sym: bool, tmp_path) -> None:
    """GPTQ with bits 8 (Qwen's GPTQ-Int8): held unpacked, int8 [N, K] with int8 zero points per group,
    run by int8.py's int8_grouped_linear."""
    logits = make_checkpoint(arch, "gptq", 32, tmp_path, sym=sym, bits=8)
    llm = load(tmp_path)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.qweight.dtype == torch.int8 and m.qweight.shape[1] % 32 == 0 for m in linears)
    assert all(m.zeros_in_use != sym for m in linears)
    prompt_logprobs_match(llm, logits)


@pytest.mark.parametrize(("group", "options"), [(64, {"act_order": True}), (-1, {}), (64, {"sym": True})])
def test_gptq_8_bit_awkward_groups_act_order_and_per_channel(
    group: int, options: dict, tmp_path, monkeypatch
):
    monkeypatch.setitem(CONFIGS, "awkward", AWKWARD_SHAPES)
    monkeypatch.setitem(ARCHITECTURES, "awkward", "LlamaForCausalLM")
    monkeypatch.setitem(AWKWARD_CONFIGS, "awkward", AWKWARD_SHAPES)
    logits = make_checkpoint("awkward", "gptq", group, tmp_path, bits=8, **options)
    prompt_logprobs_match(load(tmp_path), logits)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, r"bits 3 is not supported \(supported: 4, 8\)"),
        ({"checkpoint_format": "gptq_v2"}, "checkpoint_format 'gptq_v2'"),
        # A group size unlike the tensors': the shape error names the field.
        ({"group_size": 64}, r"layout of qzeros for this layer with quantization_config.group_size 64"),
        ({"group_size": 0}, r"group_size 0 must be positive or -1"),
        ({"group_size": "32"}, r"group_size '32' must be an integer"),
        # Missing (None: the key removed): transformers' default of 128, unlike these tensors' 32 (it was
        # read as -1).
        ({"group_size": None}, r"layout of qzeros for this layer with quantization_config.group_size 128"),
    ],
)
def test_unsupported_gptq_variants_name_the_field(change: dict, message: str, tmp_path) -> None:
    if change.get("bits") == 3:  # (and AWQ has no 8-bit format)
        make_checkpoint("llama", "awq", 32, tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"]["bits"] = 8
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match=r"bits 8 is not supported \(supported: 4\)"):
            load(tmp_path)
    make_checkpoint("llama", "gptq", 32, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    config["quantization_config"] = {k: v for k, v in config["quantization_config"].items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load(tmp_path)


# Shapes whose input rows the groups do not divide (hidden 96 against 64: a short last group of 32; an
# MLP 200 wide: 8 rows over three groups of 64); per-channel groups (-1); GPTQ's symmetric zero points.
AWKWARD_SHAPES = transformers.LlamaConfig(
    hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False,
)  # fmt: skip


@pytest.mark.parametrize(
    ("method", "group", "options"),
    [
        ("gptq", 64, {}),
        ("awq", 64, {}),
        ("gptq", 64, {"act_order": True}),
        ("gptq", -1, {}),
        ("awq", -1, {}),
        ("gptq", -1, {"act_order": True}),
        ("gptq", 32, {"sym": True}),
        ("gptq", 64, {"sym": True, "act_order": True}),
    ],
)
def test_groups_that_do_not_divide_the_rows_per_channel_and_symmetric(
    method: str, group: int, options: dict, tmp_path, monkeypatch
) -> None:
    monkeypatch.setitem(CONFIGS, "awkward", AWKWARD_SHAPES)
    monkeypatch.setitem(ARCHITECTURES, "awkward", "LlamaForCausalLM")
    monkeypatch.setitem(AWKWARD_CONFIGS, "awkward", AWKWARD_SHAPES)
    logits = make_checkpoint("awkward", method, group, tmp_path, **options)
    llm = load(tmp_path)
    prompt_logprobs_match(llm, logits)
    # GPTQ's symmetric zero points are all zero as held: its kernels take none (AWQ's are real).
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.zeros_in_use != bool(options.get("sym")) for m in linears)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_modules_to_not_convert_naming_a_fused_layers_parts(method: str, tmp_path) -> None:
    """modules_to_not_convert names the checkpoint's modules: layer 0's q, k and v projections, which
    tokenmill fuses into one qkv_proj, stay unquantized together; only some of them is a ValueError."""
    attention = "model.layers.0.self_attn."
    logits = make_checkpoint(
        "llama", method, 32, tmp_path, skip=tuple(attention + p for p in ("q_proj", "k_proj", "v_proj"))
    )
    llm = load(tmp_path)
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    prompt_logprobs_match(llm, logits)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = [attention + "q_proj"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="modules_to_not_convert leaves"):
        load(tmp_path)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_act_order_checkpoints_match_the_dequantized_model(arch: str, tmp_path) -> None:
    """desc_act: rows quantized in an order of their own (g_idx); the layer sorts its packed columns by
    group once loaded and gathers the activations the same way."""
    logits = make_checkpoint(arch, "gptq", 32, tmp_path, act_order=True)
    llm = load(tmp_path)
    ordered = [m for m in llm.engine.runner.model.modules() if getattr(m, "input_order", None) is not None]
    assert ordered and len(ordered) == len(
        [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    )
    prompt_logprobs_match(llm, logits)


def test_act_order_parts_of_a_fused_layer_must_agree(tmp_path) -> None:
    from safetensors.torch import load_file

    make_checkpoint("llama", "gptq", 32, tmp_path, act_order=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = torch.flip(tensors[name], [0]).contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="g_idx differs between the parts of one fused layer"):
        load(tmp_path)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_weight_of_an_act_order_layer_is_in_the_checkpoints_column_order(bits, tmp_path) -> None:
    """What a quantized MoE expert is turned into as it loads (quantization/moe_experts.py): the layer's
    weight with its sorted columns put back, w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]
    read straight from the GPTQ tensors (4 or 8 bits a value)."""
    from safetensors.torch import load_file

    make_checkpoint("llama", "gptq", 32, tmp_path, act_order=True, bits=bits)
    layer = load(tmp_path).engine.runner.model.model.layers[1].mlp.down_proj
    assert layer.input_order is not None
    stored = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    shifts, mask = torch.arange(32 // bits) * bits, (1 << bits) - 1
    q = ((stored[f"{name}.qweight"][:, None, :] >> shifts[None, :, None]) & mask).reshape(-1, 64)  # [K, N]
    zero = ((stored[f"{name}.qzeros"][:, :, None] >> shifts) & mask).reshape(-1, 64) + 1  # [groups, N]
    g_idx = stored[f"{name}.g_idx"].long()
    want = ((q - zero[g_idx]) * stored[f"{name}.scales"].float()[g_idx]).t()
    torch.testing.assert_close(layer.quant_method.dequantize(layer), want, atol=0, rtol=0)


def test_gptq_dynamic_rules_leave_modules_unquantized(tmp_path) -> None:
    """GPTQModel's `dynamic`: a "-:" rule's modules are stored unquantized (layer 0's MLP here, its
    fused gate/up included); a rule quantizing some modules with another group size is refused by name.
    Before, the rules were not read: the unquantized tensors matched no parameter."""
    mlp = "model.layers.0.mlp."
    logits = make_checkpoint("llama", "gptq", 32, tmp_path, skip=tuple(mlp + p for p in PROJECTIONS))
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["modules_to_not_convert"]
    config["quantization_config"]["dynamic"] = {
        r"+:.*self_attn.*": {"bits": 4, "group_size": 32},
        r"-:model\.layers\.0\.mlp\..*": {},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = load(tmp_path)
    layer = llm.engine.runner.model.model.layers[0]
    assert (
        layer.mlp.gate_up_proj.weight.dtype == torch.float32
        and layer.mlp.down_proj.weight.dtype == torch.float32
    )
    assert layer.self_attn.qkv_proj.qweight.dtype == torch.int32
    prompt_logprobs_match(llm, logits)
    config["quantization_config"]["dynamic"] = {r"+:.*down_proj": {"group_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"dynamic\['\+:\.\*down_proj'\] quantizes model.layers.0.mlp.down_proj"
    ):
        load(tmp_path)


def test_zero_biases_beside_the_quantized_linears_are_passed_over(tmp_path) -> None:
    """GPTQ-for-LLaMa and early AutoGPTQ saved a zero bias beside every quantized linear of a Llama (whose
    linears have none): such a checkpoint loads as without them; a bias that is not zero is refused."""
    from safetensors.torch import load_file

    logits = make_checkpoint("llama", "gptq", 32, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".qweight")]:
        tensors[name.replace(".qweight", ".bias")] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    prompt_logprobs_match(load(tmp_path), logits)
    tensors["model.layers.0.mlp.down_proj.bias"][0] = 1.0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.0.mlp.down_proj.bias' matches no parameter"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("method", "tensor", "dtype", "kind"),
    [
        ("gptq", "qweight", torch.float16, "integer"),
        ("gptq", "scales", torch.int32, "floating-point"),
        ("gptq", "g_idx", torch.float32, "integer"),
        ("awq", "qzeros", torch.float32, "integer"),
    ],
)
def test_a_tensor_of_the_wrong_kind_of_dtype_names_itself(method, tensor, dtype, kind, tmp_path) -> None:
    """Packed integers stored as floats (or scales as integers) would be cast by the copy into nonsense."""
    from safetensors.torch import load_file

    make_checkpoint("llama", method, 32, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = f"model.layers.1.self_attn.k_proj.{tensor}"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"'{name}': dtype .* is not the expected {kind} dtype"):
        load(tmp_path)


def test_gptq_8_bit_zero_point_0_stored_as_0xff_reads_as_256(tmp_path) -> None:
    """GPTQ stores zero - 1: a group whose weights are all >= 0 (zero point 0) has byte 0xFF, which
    AutoGPTQ's and vLLM's readers take back as 256. The layer holds that one in int16 (int8 holds 127 at
    most); a layer without such a zero keeps int8."""
    from safetensors.torch import load_file

    make_checkpoint("llama", "gptq", 32, tmp_path, bits=8)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    tensors[f"{name}.qzeros"].view(torch.uint8)[0, 0] = 0xFF  # row 0, group 0
    save_file(tensors, str(tmp_path / "model.safetensors"))
    llm = load(tmp_path)
    layers = llm.engine.runner.model.model.layers
    down, up = layers[0].mlp.down_proj, layers[1].mlp.down_proj
    assert down.qzeros.dtype == torch.int16 and up.qzeros.dtype == torch.int8
    q = tensors[f"{name}.qweight"][:, 0].contiguous().view(torch.uint8)[:32].float()  # row 0's first group
    expected = (q - 256) * tensors[f"{name}.scales"][0, 0].float()
    torch.testing.assert_close(down.quant_method.dequantize(down)[0, :32], expected)
