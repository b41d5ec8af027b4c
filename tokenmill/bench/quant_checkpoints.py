"""Quantized checkpoints of the embedded SmolLM2-135M (the GGUF model dequantized to fp32) for the
quality benchmark and its tests: `int4_smollm2`, round-to-nearest with the compressed-tensors library
(a test dependency), saved as llm-compressor would save it; `gptq_smollm2`, a GPTQ-format checkpoint
calibrated on token ids (AWQ input scaling, then true-sequential GPTQ with act-order over clipped
static groups, each linear's target moved halfway toward the full-precision model's outputs)."""

from __future__ import annotations

import copy
import os


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


# Shrink ratios of a group's range tried by the clipping search: a narrower range rounds the bulk of the
# group more finely at the cost of clipping its extremes.
CLIP_SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def group_range(block, importance, shrinks=CLIP_SHRINKS):
    """Asymmetric 4-bit (scale, zero) [N] of a group of weights [N, G]: of the range [min, max] (widened
    to hold 0, which integer zero points always represent) shrunk by each ratio, the one whose
    round-to-nearest error, each column weighted by importance [G] (the diagonal of X^T X: how strongly
    its input drives the output), is least. Zero points stay in 1..15: GPTQ stores zero - 1 in 4 bits."""
    import torch

    lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
    best = None
    for ratio in shrinks:
        scale = ((hi - lo) * ratio / 15).clamp(min=1e-8).half().double()  # as the checkpoint stores it
        zero = torch.round(-lo * ratio / scale).clamp(1, 15)
        q = torch.round(block / scale[:, None] + zero[:, None]).clamp(0, 15)
        error = (((q - zero[:, None]) * scale[:, None] - block) ** 2 * importance).sum(1)
        if best is None:
            best = (error, scale, zero)
        else:
            better = error < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((error, scale, zero), best))
    return best[1], best[2]


def gptq_quantize(
    weight, hessian, group_size: int, damp: float = 0.01, block_size: int = 128, ranges: tuple | None = None
):
    """GPTQ (Frantar et al., 2022) of one linear weight [N, K] with asymmetric 4-bit groups along K:
    columns are quantized one at a time, each one's rounding error spread over the columns not yet
    quantized through the inverse Hessian of the layer's inputs (H = X^T X). Columns go in order of
    descending H diagonal (act-order: the most influential first, while the most columns remain to
    absorb their error) with each group's range fixed beforehand from the original weights by a
    clipping search ("static groups"), so the checkpoint keeps desc_act false and a plain g_idx.
    ranges: (scale, zero) [G, N] to use instead of the clipping search's.
    Returns (q [N, K] in 0..15, scale [G, N], zero [G, N]) with w ~= (q - zero) * scale."""
    import torch

    w = weight.double().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    importance = torch.diag(h).clone()
    groups = torch.arange(k) // group_size
    if ranges is None:
        found = [group_range(w[:, groups == g], importance[groups == g]) for g in range(int(groups[-1]) + 1)]
        scale, zero = torch.stack([r[0] for r in found]), torch.stack([r[1] for r in found])
    else:
        scale, zero = ranges
    order = torch.argsort(importance, descending=True)
    w, h = w[:, order], h[order][:, order]
    column_scale, column_zero = scale[groups[order]].t(), zero[groups[order]].t()  # [N, K], in order
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.int64)
    for start in range(0, k, block_size):  # lazy batches: the rest of W is updated once per block
        end = min(start + block_size, k)
        block, h_block = w[:, start:end].clone(), h_inv[start:end, start:end]
        errors = torch.zeros_like(block)
        for i in range(end - start):
            s, z = column_scale[:, start + i], column_zero[:, start + i]
            q[:, start + i] = torch.round(block[:, i] / s + z).clamp(0, 15).long()
            errors[:, i] = (block[:, i] - (q[:, start + i] - z) * s) / h_block[i, i]
            block[:, i:] -= errors[:, i, None] * h_block[i, i:][None, :]
        w[:, end:] -= errors @ h_inv[start:end, end:]
    unordered = torch.empty_like(q)
    unordered[:, order] = q
    return unordered, scale, zero


def refit_scales(weight, hessian, q, scale, zero, group_size: int):
    """The groups' scales [G, N] that, with GPTQ's codes q [N, K] and zero points fixed, minimise the
    layer's output error on the calibration inputs, tr((W - W') H (W - W')^T) with W' = (q - zero) *
    scale: a least-squares problem of G unknowns per output row (GPTQ chose the codes column by column;
    the scales were fixed before it). A row whose system is singular, or a scale that comes out not
    positive, keeps the old one."""
    import torch

    w, h = weight.double(), hessian.double()
    n, k = w.shape
    groups = torch.arange(k) // group_size
    count = int(groups[-1]) + 1
    codes = (q - zero[groups].t()).double()  # [N, K]
    a = torch.zeros(n, count, count, dtype=torch.float64)
    for g in range(count):
        rows_g = groups == g
        cross = codes[:, rows_g] @ h[rows_g]  # [N, K]
        for g2 in range(count):
            a[:, g, g2] = (cross[:, groups == g2] * codes[:, groups == g2]).sum(1)
    wh = w @ h
    b = torch.stack([(wh[:, groups == g] * codes[:, groups == g]).sum(1) for g in range(count)], 1)
    ridge = 1e-9 * a.diagonal(dim1=1, dim2=2).mean(1).clamp(min=1e-30)
    a = a + ridge[:, None, None] * torch.eye(count, dtype=torch.float64)
    solved, info = torch.linalg.solve_ex(a, b[:, :, None])
    new = solved[:, :, 0].t()  # [G, N]
    ok = (info == 0)[None, :] & torch.isfinite(new) & (new > 0)
    return torch.where(ok, new, scale.double())


def awq_scales(weights, hessian, mean_abs, grid: int = 20):
    """AWQ (Lin et al., 2023): per-input-channel scales s = mean|x|^alpha (normalised to geometric mean
    1) for linears sharing one input, with alpha in [0, 1) chosen on the calibration data to minimise
    the output error sum((dW H) * dW) of group-128 round-to-nearest applied to W * s (then / s).
    Quantizing W * s on inputs x / s lets the channels with large activations keep more precision."""
    import torch

    w, h = torch.cat(weights).float(), hessian.float()
    best = None
    for step in range(grid):
        s = mean_abs.float().clamp(min=1e-4) ** (step / grid)
        s = s / (s.max() * s.min()).sqrt()
        error = _round_to_nearest(w * s) / s - w
        loss = ((error @ h) * error).sum().item()
        if best is None or loss < best[0]:
            best = (loss, s.double())
    return best[1]


def _round_to_nearest(w, group_size: int = 128):
    """Asymmetric 4-bit round-to-nearest of w [N, K] in groups along K (the range holding 0)."""
    import torch

    blocks = []
    for block in w.split(group_size, dim=1):
        lo, hi = block.amin(1, keepdim=True).clamp(max=0), block.amax(1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(1, 15)
        blocks.append((torch.round(block / scale + zero).clamp(0, 15) - zero) * scale)
    return torch.cat(blocks, dim=1)


def _fold_awq_scales(linears: list, source, hessian, mean_abs):
    """Scale the inputs of `linears` (sharing one input) by AWQ's factors: the weights' columns by s,
    the operation producing the input (`source`: an RMSNorm weight, or up_proj's rows for down_proj) by
    1/s, so the layer computes the same function; returns the Hessian of the scaled inputs."""
    s = awq_scales([m.weight.data for m in linears], hessian, mean_abs)
    for m in linears:
        m.weight.data = (m.weight.data.double() * s).float()
    source.data = (source.data.double() / (s if source.dim() == 1 else s[:, None])).float()
    return hessian / (s[:, None] * s[None, :])


def _cross_statistics(reference: list, inputs: list):
    """X^T X~ summed over the tokens: the full-precision model's inputs of a linear (X) against the inputs
    it sees with everything before it quantized (X~), one tensor per calibration sequence each."""
    cross = 0
    for x, y in zip(reference, inputs):
        cross = cross + x.reshape(-1, x.shape[-1]).double().t() @ y.reshape(-1, y.shape[-1]).double()
    return cross


def compensated_target(weight, hessian, cross, damp: float = 0.01):
    """The weight whose output on the quantized path's inputs X~ best matches the full-precision layer's
    output on its own inputs X: argmin_W' |X W^T - X~ W'^T|^2 = W (X^T X~) (X~^T X~)^-1, written as W plus
    a correction for the inputs' difference, W ((X - X~)^T X~) (X~^T X~)^-1, so that the damping (as
    GPTQ damps its Hessian) shrinks only the correction: damping the whole product would pull W toward
    zero along the directions the calibration rarely excites, even where X = X~. Blended by COMPENSATE.
    GPTQ then quantizes this target, so each layer also absorbs the error the layers before it left in
    its inputs (as GPTAQ, Li et al., 2025)."""
    import torch

    h = hessian.double()
    h = h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    w = weight.double()
    correction = torch.linalg.solve(h, (cross.double() - hessian.double()).t() @ w.t()).t()
    return (w + COMPENSATE * correction).float()


def _input_statistics(inputs: list) -> tuple:
    """X^T X and |X| summed over the tokens (AWQ needs only each channel's relative size, so a sum
    serves as a mean) of a linear's inputs, one tensor per calibration sequence."""
    hessian = abs_sum = 0
    for x in inputs:
        x = x.reshape(-1, x.shape[-1]).double()
        hessian = hessian + x.t() @ x
        abs_sum = abs_sum + x.abs().sum(0)
    return hessian, abs_sum


REFIT_SCALES = True  # least-squares scales for GPTQ's codes (refit_scales)
# Further rounds of GPTQ's codes under the refit scales, then scales refit to those codes; the round
# with the least output error is kept (GPTQ's codes are not optimal for given scales, so a round can
# come out worse than the one before and a later one better again).
REFINE_ROUNDS = 4
# How far each linear's target moves from its weight toward compensated_target (0: plain GPTQ). Half the
# way scored best on the scored text and on held-out text alike; the whole way overcorrects
# (docs/performance.md, twenty-first session).
COMPENSATE = 0.5


def output_error(weight, hessian, q, scale, zero, group_size: int) -> float:
    """The layer's output error on the calibration inputs, tr((W - W') H (W - W')^T)."""
    import torch

    groups = torch.arange(weight.shape[1]) // group_size
    delta = weight.double() - (q - zero[groups].t()) * scale[groups].t()
    return float(((delta @ hessian.double()) * delta).sum())


def _quantize_into(tensors: dict, name: str, linear, hessian, group_size: int, cross=None) -> None:
    """GPTQ of one linear: its packed tensors into `tensors` under `name`, its weight replaced by the
    dequantized one, so the sublayers after it calibrate on what the checkpoint will compute. With
    `cross` (X^T X~, _cross_statistics) the target is compensated_target's, not the weight."""
    import torch

    weight = linear.weight.data
    if cross is not None and COMPENSATE:
        weight = compensated_target(weight, hessian, cross)
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
    hessian, mean_abs = _input_statistics([layer.input_layernorm(x) for x in hidden])
    hessian = _fold_awq_scales(qkv, layer.input_layernorm.weight, hessian, mean_abs)
    attn_fp = copy.deepcopy(attn)
    normed = [layer.input_layernorm(x) for x in hidden]
    normed_fp = [layer.input_layernorm(x) for x in hidden_fp]
    cross = _cross_statistics(normed_fp, normed)
    for name, linear in zip(("q_proj", "k_proj", "v_proj"), qkv):
        _quantize_into(tensors, f"{prefix}.self_attn.{name}", linear, hessian, group_size, cross)
    o_inputs, o_inputs_fp = _o_proj_inputs(attn, normed, rotary), _o_proj_inputs(attn_fp, normed_fp, rotary)
    _quantize_into(
        tensors, f"{prefix}.self_attn.o_proj", attn.o_proj, _input_statistics(o_inputs)[0], group_size,
        _cross_statistics(o_inputs_fp, o_inputs),
    )  # fmt: skip
    residual = [
        x + attn(y, attention_mask=None, position_embeddings=p)[0] for x, y, p in zip(hidden, normed, rotary)
    ]
    residual_fp = [
        x + attn_fp(y, attention_mask=None, position_embeddings=p)[0]
        for x, y, p in zip(hidden_fp, normed_fp, rotary)
    ]
    mlp_inputs = [layer.post_attention_layernorm(x) for x in residual]
    hessian, mean_abs = _input_statistics(mlp_inputs)
    down_hessian, down_mean_abs = _input_statistics(
        [mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) for x in mlp_inputs]
    )
    hessian = _fold_awq_scales(
        [mlp.gate_proj, mlp.up_proj], layer.post_attention_layernorm.weight, hessian, mean_abs
    )
    _fold_awq_scales([mlp.down_proj], mlp.up_proj.weight, down_hessian, down_mean_abs)
    mlp_fp = copy.deepcopy(mlp)
    mlp_inputs = [layer.post_attention_layernorm(x) for x in residual]
    mlp_inputs_fp = [layer.post_attention_layernorm(x) for x in residual_fp]
    cross = _cross_statistics(mlp_inputs_fp, mlp_inputs)
    for name in ("gate_proj", "up_proj"):
        _quantize_into(tensors, f"{prefix}.mlp.{name}", mlp.get_submodule(name), hessian, group_size, cross)
    down_inputs = [mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x) for x in mlp_inputs]
    down_inputs_fp = [mlp_fp.act_fn(mlp_fp.gate_proj(x)) * mlp_fp.up_proj(x) for x in mlp_inputs_fp]
    _quantize_into(
        tensors, f"{prefix}.mlp.down_proj", mlp.down_proj, _input_statistics(down_inputs)[0], group_size,
        _cross_statistics(down_inputs_fp, down_inputs),
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
