"""Quantized checkpoints of the embedded SmolLM2-135M, made with the compressed-tensors library, for the
quality benchmark and its test: the GGUF model dequantized to fp32, its linear layers quantized with
round-to-nearest (no calibration data), compressed and saved as llm-compressor would save them.
Needs the `compressed-tensors` package (a test dependency)."""

from __future__ import annotations

import copy
import os


def int4_smollm2(path: str, group_size: int = 64, symmetric: bool = False) -> str:
    """Save a W4A16 `pack-quantized` SmolLM2 at `path` (the LM head stays unquantized); returns path."""
    import torch
    import transformers
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    from tokenmill.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    gguf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(gguf.config)
    if hasattr(config, "quantization_config"):  # the GGUF marker: a model carrying it cannot be saved
        delattr(config, "quantization_config")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(gguf.state_dict())
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


def gptq_quantize(weight, hessian, group_size: int, damp: float = 0.01):
    """GPTQ (Frantar et al., 2022) of one linear weight [N, K] with asymmetric 4-bit groups along K:
    columns are quantized in order, each one's rounding error spread over the columns not yet
    quantized through the inverse Hessian of the layer's inputs (H = X^T X). Returns (q [N, K] in
    0..15, scale [G, N], zero [G, N]) with w ~= (q - zero) * scale."""
    import torch

    w = weight.double().clone()
    n, k = w.shape
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.int64)
    groups = -(-k // group_size)
    scale = torch.zeros(groups, n, dtype=torch.float64)
    zero = torch.zeros(groups, n, dtype=torch.float64)
    for col in range(k):
        g = col // group_size
        if col % group_size == 0:  # the group's range, from the weights as GPTQ has updated them
            block = w[:, col : col + group_size]
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scale[g] = ((hi - lo) / 15).clamp(min=1e-8).half().double()
            zero[g] = torch.round(-lo / scale[g]).clamp(0, 15)
        column = w[:, col]
        q[:, col] = torch.round(column / scale[g] + zero[g]).clamp(0, 15).long()
        error = (column - (q[:, col] - zero[g]) * scale[g]) / h_inv[col, col]
        w[:, col:] -= error[:, None] * h_inv[col, col:][None, :]
    return q, scale, zero


def gptq_smollm2(path: str, calibration: list[list[int]], group_size: int = 128) -> str:
    """Save a GPTQ-format (checkpoint_format gptq, desc_act false) 4-bit SmolLM2 at `path`, calibrated
    on `calibration` (token ids): layer by layer, each linear's Hessian from the inputs it sees with the
    layers before it already quantized. The LM head stays unquantized."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    from tokenmill.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    gguf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = copy.deepcopy(gguf.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(gguf.state_dict())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    tensors = {}
    for index in range(len(model.model.layers)):
        own = {n: m for n, m in linears.items() if n.startswith(f"model.layers.{index}.")}
        hessians = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in own.items()}
        hooks = [m.register_forward_pre_hook(_accumulate_into(hessians, n)) for n, m in own.items()]
        with torch.no_grad():
            for ids in calibration:  # the layers before this one are quantized already
                model(torch.tensor([ids]))
        for hook in hooks:
            hook.remove()
        for n, m in own.items():
            q, scale, zero = gptq_quantize(m.weight.data, hessians[n], group_size)
            k = m.in_features
            groups = torch.arange(k) // group_size
            m.weight.data = ((q - zero[groups].t()) * scale[groups].t()).float()
            tensors[f"{n}.qweight"] = pack_gptq_rows(q.t())
            tensors[f"{n}.qzeros"] = pack_columns((zero - 1).long())  # GPTQ stores zero - 1
            tensors[f"{n}.scales"] = scale.half().contiguous()
            tensors[f"{n}.g_idx"] = groups.to(torch.int32)
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


def _accumulate_into(hessians: dict, name: str):
    """A forward pre-hook adding X^T X of the layer's input to hessians[name]."""

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        hessians[name] += x.t() @ x

    return hook
