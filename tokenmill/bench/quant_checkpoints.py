"""Quantized checkpoints of the embedded SmolLM2-135M (the GGUF model dequantized to fp32) for the
quality benchmark and its tests: `int4_smollm2`, round-to-nearest with the compressed-tensors library
(a test dependency), saved as llm-compressor would save it; `gptq_smollm2`, a GPTQ-format checkpoint
calibrated on token ids (AWQ input scaling, then GPTQ with act-order over clipped static groups)."""

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
CLIP_FULL = False


def group_range(block, hessian, shrinks=None):
    """Asymmetric 4-bit (scale, zero) [N] of a group of weights [N, G]: of the range [min, max] (widened
    to hold 0, which integer zero points always represent) shrunk by each ratio, the one whose
    round-to-nearest error, each column weighted by importance [G] (the diagonal of X^T X: how strongly
    its input drives the output), is least. Zero points stay in 1..15: GPTQ stores zero - 1 in 4 bits."""
    import torch

    shrinks = CLIP_SHRINKS if shrinks is None else shrinks
    lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
    best = None
    for ratio in shrinks:
        scale = ((hi - lo) * ratio / 15).clamp(min=1e-8).half().double()  # as the checkpoint stores it
        zero = torch.round(-lo * ratio / scale).clamp(1, 15)
        q = torch.round(block / scale[:, None] + zero[:, None]).clamp(0, 15)
        delta = (q - zero[:, None]) * scale[:, None] - block
        if CLIP_FULL:
            error = ((delta @ hessian) * delta).sum(1)
        else:
            error = (delta**2 * torch.diag(hessian)).sum(1)
        if best is None:
            best = (error, scale, zero)
        else:
            better = error < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((error, scale, zero), best))
    return best[1], best[2]


GPTQ_DAMP = 0.01


def gptq_quantize(weight, hessian, group_size: int, damp: float | None = None, block_size: int = 128):
    """GPTQ (Frantar et al., 2022) of one linear weight [N, K] with asymmetric 4-bit groups along K:
    columns are quantized one at a time, each one's rounding error spread over the columns not yet
    quantized through the inverse Hessian of the layer's inputs (H = X^T X). Columns go in order of
    descending H diagonal (act-order: the most influential first, while the most columns remain to
    absorb their error) with each group's range fixed beforehand from the original weights by a
    clipping search ("static groups"), so the checkpoint keeps desc_act false and a plain g_idx.
    Returns (q [N, K] in 0..15, scale [G, N], zero [G, N]) with w ~= (q - zero) * scale."""
    import torch

    damp = GPTQ_DAMP if damp is None else damp
    w = weight.double().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    importance = torch.diag(h).clone()
    groups = torch.arange(k) // group_size
    ranges = [group_range(w[:, groups == g], h[groups == g][:, groups == g]) for g in range(int(groups[-1]) + 1)]
    scale = torch.stack([r[0] for r in ranges])
    zero = torch.stack([r[1] for r in ranges])
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


def _fold_awq_scales(layer, names, source, hessians: dict, mean_abs: dict) -> None:
    """Scale the inputs of the linears `names` (sharing one input) by AWQ's factors: the weights'
    columns by s, the operation producing the input (`source`: an RMSNorm weight, or up_proj's rows for
    down_proj) by 1/s, and the Hessians to match, so the layer computes the same function."""
    linears = [layer.get_submodule(n) for n in names]
    s = awq_scales([m.weight.data for m in linears], hessians[names[0]], mean_abs[names[0]])
    for m, name in zip(linears, names):
        m.weight.data = (m.weight.data.double() * s).float()
        hessians[name] /= s[:, None] * s[None, :]
    source.data = (source.data.double() / (s if source.dim() == 1 else s[:, None])).float()


def _input_statistics(layer, names, hidden: list, rotary: list) -> tuple[dict, dict]:
    """X^T X and |X| summed over the tokens of the inputs of the layer's linears `names`, over one pass
    of the calibration's hidden states through the layer as it stands."""
    import torch

    hessians, abs_sums, hooks = {}, {}, []
    for n in names:
        m = layer.get_submodule(n)
        hessians[n] = torch.zeros(m.in_features, m.in_features, dtype=torch.float64)
        abs_sums[n] = torch.zeros(m.in_features, dtype=torch.float64)
        hooks.append(m.register_forward_pre_hook(_accumulate_into(hessians, abs_sums, n)))
    with torch.no_grad():
        for x, position_embeddings in zip(hidden, rotary):
            layer(x, attention_mask=None, position_embeddings=position_embeddings)
    for hook in hooks:
        hook.remove()
    return hessians, abs_sums


QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP = ("mlp.gate_proj", "mlp.up_proj")
SEQUENTIAL = True


def gptq_smollm2(path: str, calibration: list[list[int]], group_size: int = 128) -> str:
    """Save a GPTQ-format (checkpoint_format gptq, desc_act false) 4-bit SmolLM2 at `path`, calibrated
    on `calibration` (token ids, one sequence each). Layer by layer, each linear's Hessian comes from the
    inputs it sees with the layers before it already quantized: the calibration's hidden states are
    kept between layers, so each layer runs once over them. The LM head stays unquantized."""
    import json

    import torch
    from safetensors.torch import save_file

    model = _smollm2_fp32()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    tensors = {}
    with torch.no_grad():
        hidden = [model.model.embed_tokens(torch.tensor([ids])) for ids in calibration]
        rotary = [model.model.rotary_emb(x, torch.arange(x.shape[1])[None]) for x in hidden]
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."

        def quantize(names, hessians):
            for n in names:
                m = layer.get_submodule(n)
                q, scale, zero = gptq_quantize(m.weight.data, hessians[n], group_size)
                groups = torch.arange(m.in_features) // group_size
                m.weight.data = ((q - zero[groups].t()) * scale[groups].t()).float()
                tensors[f"{prefix}{n}.qweight"] = pack_gptq_rows(q.t())
                tensors[f"{prefix}{n}.qzeros"] = pack_columns((zero - 1).long())  # GPTQ stores zero - 1
                tensors[f"{prefix}{n}.scales"] = scale.half().contiguous()
                tensors[f"{prefix}{n}.g_idx"] = groups.to(torch.int32)

        if SEQUENTIAL:
            hessians, mean_abs = _input_statistics(layer, QKV, hidden, rotary)
            _fold_awq_scales(layer, QKV, layer.input_layernorm.weight, hessians, mean_abs)
            quantize(QKV, hessians)
            hessians, _ = _input_statistics(layer, ("self_attn.o_proj",), hidden, rotary)
            quantize(("self_attn.o_proj",), hessians)
            hessians, mean_abs = _input_statistics(layer, GATE_UP + ("mlp.down_proj",), hidden, rotary)
            _fold_awq_scales(layer, GATE_UP, layer.post_attention_layernorm.weight, hessians, mean_abs)
            _fold_awq_scales(layer, ("mlp.down_proj",), layer.mlp.up_proj.weight, hessians, mean_abs)
            quantize(GATE_UP, hessians)
            hessians, _ = _input_statistics(layer, ("mlp.down_proj",), hidden, rotary)
            quantize(("mlp.down_proj",), hessians)
        else:
            names = QKV + ("self_attn.o_proj",) + GATE_UP + ("mlp.down_proj",)
            hessians, mean_abs = _input_statistics(layer, names, hidden, rotary)
            _fold_awq_scales(layer, QKV, layer.input_layernorm.weight, hessians, mean_abs)
            _fold_awq_scales(layer, GATE_UP, layer.post_attention_layernorm.weight, hessians, mean_abs)
            _fold_awq_scales(layer, ("mlp.down_proj",), layer.mlp.up_proj.weight, hessians, mean_abs)
            quantize(names, hessians)
        with torch.no_grad():  # the next layer's inputs, through this layer quantized
            hidden = [layer(x, attention_mask=None, position_embeddings=p) for x, p in zip(hidden, rotary)]
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


def _accumulate_into(hessians: dict, abs_sums: dict, name: str):
    """A forward pre-hook adding X^T X of the layer's input to hessians[name] and |X| summed over the
    tokens to abs_sums[name] (AWQ needs only each channel's relative size, so a sum serves as a mean)."""

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        hessians[name] += x.t() @ x
        abs_sums[name] += x.abs().sum(0)

    return hook
