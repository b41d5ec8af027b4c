"""Quantized checkpoints of the embedded SmolLM2-135M (the GGUF model dequantized to fp32) for the
quality benchmark and its tests: `int4_smollm2`, round-to-nearest with the compressed-tensors library
(a test dependency), saved as llm-compressor would save it; `gptq_smollm2`, a GPTQ-format checkpoint
calibrated on token ids (AWQ input scaling, then true-sequential GPTQ with act-order over clipped
static groups, each linear's target moved halfway toward the full-precision model's outputs; the
per-linear mathematics in tokenmill/bench/gptq.py)."""

from __future__ import annotations

import copy
import os

from tokenmill.bench.gptq import (
    compensated_target,
    cross_statistics,
    fold_awq_scales,
    gptq_quantize,
    input_statistics,
    output_error,
    refit_scales,
)


def _smollm2_fp32():
    """The embedded GGUF SmolLM2 dequantized to an fp32 transformers model that can be saved."""
    import torch
    import transformers

    from tokenmill.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    gguf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(gguf.config)
    if hasattr(config, "quantization_config"):  # the GGUF marker: a model carrying it cannot be saved
        delattr(config, "quantization_config")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(gguf.state_dict())
    return model


def int4_smollm2(path: str, group_size: int = 64, symmetric: bool = False) -> str:
    """Save a W4A16 `pack-quantized` SmolLM2 at `path` (the LM head stays unquantized); returns path."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _smollm2_fp32()
    weights = QuantizationArgs(
        num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=symmetric, dynamic=False
    )
    scheme = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
        quantization_status=QuantizationStatus.INITIALIZED,
        format="pack-quantized",
    )
    apply_quantization_config(model, scheme)
    for module in model.modules():
        args = getattr(module, "quantization_scheme", None)
        if args is None:
            continue
        w = module.weight.data
        groups = w.reshape(w.shape[0], -1, group_size)
        scale, zero = calculate_qparams(
            groups.amin(-1).reshape(-1), groups.amax(-1).reshape(-1), args.weights
        )
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
    ModelCompressor(quantization_config=scheme).compress_model(model)
    model.save_pretrained(path)
    ModelCompressor(quantization_config=scheme).update_config(path)
    return path


CALIBRATION_TOPICS = (
    "the history of bridges", "how bees make honey", "a walk in autumn", "the first computers",
    "cooking rice", "sailing ships", "the water cycle", "learning a language", "a village baker",
    "the moon landing", "growing tomatoes", "an old lighthouse", "trains in the nineteenth century",
    "how clocks work", "a winter storm", "the life of a river", "medieval castles", "a small bookshop",
    "volcanoes", "the printing press", "a family farm", "mountain climbing", "the ocean floor",
    "a market town", "birds that migrate", "the invention of paper", "a carpenter's workshop",
    "rain forests", "a fishing village", "the roman roads", "a letter from a soldier", "windmills",
)  # fmt: skip
CALIBRATION_STYLES = ("Write a few paragraphs about {}.", "Tell a short story about {}.")


def gptq_calibration_ids(num_sequences: int = 64, max_tokens: int = 256) -> list[list[int]]:
    """GPTQ's calibration set: text the embedded model writes itself (never the scored text), one chat
    per topic and style, sampled at temperature 0.9: 64 sequences of ~290 tokens (~18,000 tokens, more
    than ten times the widest layer input, 1,536) as token ids with their chat prompts."""
    from tokenmill import LLM, SamplingParams

    prompts = [style.format(topic) for style in CALIBRATION_STYLES for topic in CALIBRATION_TOPICS]
    chats = [[{"role": "user", "content": prompt}] for prompt in prompts[:num_sequences]]
    blocks = num_sequences * (max_tokens + 64) // 16 + 64  # the prompts are ~40 tokens; blocks of 16
    llm = LLM("default", max_model_len=4096, num_kv_blocks=blocks, dtype="float32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=0)
    outputs = llm.chat(chats, params, use_tqdm=False)
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]


# ---- GPTQ -------------------------------------------------------------------------------------------


def to_int32(words):
    """int64 words holding 32 bits -> int32 (two's complement), as checkpoints store them."""
    import torch

    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def pack_gptq_rows(values):
    """GPTQ qweight: 4-bit values [K, N], eight rows to a word, row 8r + j in bits 4j -> [K/8, N]."""
    v = values.long().reshape(-1, 8, values.shape[1])
    return to_int32(sum(v[:, j] << (4 * j) for j in range(8)))


def pack_columns(values, order=tuple(range(8))):
    """[R, C] -> [R, C/8]: nibble j of word c holds column 8c + order[j] (AWQ: 0, 2, 4, 6, 1, 3, 5, 7)."""
    v = values.long().reshape(values.shape[0], -1, 8)
    return to_int32(sum(v[:, :, order[j]] << (4 * j) for j in range(8)))


def pack_bytes(values):
    """8-bit values 0..255 [R, C] -> int32 [R, C/4], column 4c + j in bits 8j of word c (GPTQ's 8-bit
    qzeros as stored; its qweight is the same along K: pack_bytes(q.t()).t())."""
    v = values.long().reshape(values.shape[0], -1, 4)
    return to_int32(sum(v[:, :, j] << (8 * j) for j in range(4)))


REFIT_SCALES = True  # least-squares scales for GPTQ's codes (refit_scales)
# Further rounds of GPTQ's codes under the refit scales, then scales refit to those codes; the round
# with the least output error is kept (GPTQ's codes are not optimal for given scales, so a round can
# come out worse than the one before and a later one better again).
REFINE_ROUNDS = 4
# How far each linear's target moves from its weight toward compensated_target (0: plain GPTQ). Half the
# way scored best on the scored text and on held-out text alike; the whole way overcorrects
# (docs/performance.md, twenty-first session).
COMPENSATE = 0.5


def _quantize_into(tensors: dict, name: str, linear, hessian, group_size: int, cross=None) -> None:
    """GPTQ of one linear: its packed tensors into `tensors` under `name`, its weight replaced by the
    dequantized one, so the sublayers after it calibrate on what the checkpoint will compute. With
    `cross` (X^T X~, cross_statistics) the target is compensated_target's, not the weight."""
    import torch

    weight = linear.weight.data
    if cross is not None and COMPENSATE:
        weight = compensated_target(weight, hessian, cross, COMPENSATE)
    q, scale, zero = gptq_quantize(weight, hessian, group_size)
    if REFIT_SCALES:
        best = None
        for round_ in range(1 + REFINE_ROUNDS):
            if round_:
                q = gptq_quantize(weight, hessian, group_size, ranges=(scale, zero))[0]
            scale = refit_scales(weight, hessian, q, scale, zero, group_size).half().double()
            error = output_error(weight, hessian, q, scale, zero, group_size)
            if best is None or error < best[0]:
                best = (error, q, scale)
        _, q, scale = best
    groups = torch.arange(linear.in_features) // group_size
    linear.weight.data = ((q - zero[groups].t()) * scale[groups].t()).float()
    tensors[f"{name}.qweight"] = pack_gptq_rows(q.t())
    tensors[f"{name}.qzeros"] = pack_columns((zero - 1).long())  # GPTQ stores zero - 1
    tensors[f"{name}.scales"] = scale.half().contiguous()
    tensors[f"{name}.g_idx"] = groups.to(torch.int32)


def gptq_smollm2(path: str, calibration: list[list[int]], group_size: int = 128) -> str:
    """Save a GPTQ-format (checkpoint_format gptq, desc_act false) 4-bit SmolLM2 at `path`, calibrated
    on `calibration` (token ids, one sequence each). Layer by layer and, inside a layer, sublayer by
    sublayer (true-sequential), each linear's Hessian comes from the inputs it sees with everything
    before it already quantized: the calibration's hidden states are kept between layers, and each
    layer's intermediate activations are computed once per sublayer. The full-precision model's hidden
    states are carried beside them, for compensated_target. The LM head stays unquantized."""
    import json

    import torch
    from safetensors.torch import save_file

    model = _smollm2_fp32()
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    tensors = {}
    with torch.no_grad():
        hidden = [model.model.embed_tokens(torch.tensor([ids])) for ids in calibration]
        rotary = [model.model.rotary_emb(x, torch.arange(x.shape[1])[None]) for x in hidden]
        hidden_fp = list(hidden)
        for index, layer in enumerate(model.model.layers):
            hidden, hidden_fp = _quantize_layer(
                layer, f"model.layers.{index}", hidden, hidden_fp, rotary, tensors, group_size
            )
    for n, param in model.named_parameters():
        if n.rsplit(".", 1)[0] not in linears:
            tensors[n] = param.data.contiguous()
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config_dict = model.config.to_dict()
    config_dict["architectures"] = [type(model).__name__]
    config_dict["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
        "checkpoint_format": "gptq",
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_dict, f)
    return path


def _quantize_layer(
    layer, prefix: str, hidden: list, hidden_fp: list, rotary: list, tensors: dict, group_size: int
) -> tuple[list, list]:
    """Quantize one decoder layer true-sequentially: q/k/v, then o_proj, gate/up, down_proj, each one's
    Hessian from its inputs through the sublayers before it already quantized (as GPTQ's reference
    does), and its target from the same inputs of the full-precision model (hidden_fp through copies of
    the sublayers taken after AWQ's folding, before quantization). AWQ scales the inputs of q/k/v,
    gate/up and down; o_proj is left alone: its input channels come from value heads shared by several
    query heads. Returns the next layer's inputs, quantized and full-precision."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
    hessian, mean_abs = input_statistics([layer.input_layernorm(x) for x in hidden])
    hessian = fold_awq_scales(qkv, layer.input_layernorm.weight, hessian, mean_abs)
    attn_fp = copy.deepcopy(attn)
    normed = [layer.input_layernorm(x) for x in hidden]
    normed_fp = [layer.input_layernorm(x) for x in hidden_fp]
    cross = cross_statistics(normed_fp, normed)
    for name, linear in zip(("q_proj", "k_proj", "v_proj"), qkv):
        _quantize_into(tensors, f"{prefix}.self_attn.{name}", linear, hessian, group_size, cross)
    o_inputs, o_inputs_fp = _o_proj_inputs(attn, normed, rotary), _o_proj_inputs(attn_fp, normed_fp, rotary)
    _quantize_into(
        tensors, f"{prefix}.self_attn.o_proj", attn.o_proj, input_statistics(o_inputs)[0], group_size,
        cross_statistics(o_inputs_fp, o_inputs),
    )  # fmt: skip
    residual = [
        x + attn(y, attention_mask=None, position_embeddings=p)[0] for x, y, p in zip(hidden, normed, rotary)
    ]
    residual_fp = [
        x + attn_fp(y, attention_mask=None, position_embeddings=p)[0]
        for x, y, p in zip(hidden_fp, normed_fp, rotary)
    ]
    mlp_inputs = [layer.post_attention_layernorm(x) for x in residual]
    hessian, mean_abs = input_statistics(mlp_inputs)
    down_hessian, down_mean_abs = input_statistics(
        [mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) for x in mlp_inputs]
    )
    hessian = fold_awq_scales(
        [mlp.gate_proj, mlp.up_proj], layer.post_attention_layernorm.weight, hessian, mean_abs
    )
    fold_awq_scales([mlp.down_proj], mlp.up_proj.weight, down_hessian, down_mean_abs)
    mlp_fp = copy.deepcopy(mlp)
    mlp_inputs = [layer.post_attention_layernorm(x) for x in residual]
    mlp_inputs_fp = [layer.post_attention_layernorm(x) for x in residual_fp]
    cross = cross_statistics(mlp_inputs_fp, mlp_inputs)
    for name in ("gate_proj", "up_proj"):
        _quantize_into(tensors, f"{prefix}.mlp.{name}", mlp.get_submodule(name), hessian, group_size, cross)
    down_inputs = [mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) for x in mlp_inputs]
    down_inputs_fp = [mlp_fp.act_fn(mlp_fp.gate_proj(x)) * mlp_fp.up_proj(x) for x in mlp_inputs_fp]
    _quantize_into(
        tensors, f"{prefix}.mlp.down_proj", mlp.down_proj, input_statistics(down_inputs)[0], group_size,
        cross_statistics(down_inputs_fp, down_inputs),
    )  # fmt: skip
    return (
        [x + mlp.down_proj(y) for x, y in zip(residual, down_inputs)],
        [x + mlp_fp.down_proj(y) for x, y in zip(residual_fp, down_inputs_fp)],
    )


def _o_proj_inputs(attn, normed: list, rotary: list) -> list:
    """What o_proj receives from `attn` over the calibration's normed hidden states."""
    inputs = []
    hook = attn.o_proj.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    for x, position_embeddings in zip(normed, rotary):
        attn(x, attention_mask=None, position_embeddings=position_embeddings)
    hook.remove()
    return inputs
