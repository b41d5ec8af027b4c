"""Hugging Face model directories: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch


def load_hf_config(path: str):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"model {path!r}: cannot read config.json ({exc}).") from exc
    if getattr(config, "quantization_config", None) is None:
        stored = quantization_config_beside(path)
        if stored is not None:
            config.quantization_config = stored
    return config


def quantization_config_beside(path: str) -> dict | None:
    """The quantization config of checkpoints that keep it beside config.json, as AutoGPTQ wrote it
    (quantize_config.json), AutoAWQ (quant_config.json) and NVIDIA's Model Optimizer
    (hf_quant_config.json, read as it is by layers/quantization/modelopt.py), in config.json's
    quantization_config form."""
    for name, method in (
        ("quantize_config.json", "gptq"), ("quant_config.json", "awq"), ("hf_quant_config.json", "modelopt")
    ):  # fmt: skip
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        with open(file) as f:
            stored = json.load(f)
        if method == "awq" and "w_bit" in stored:  # AutoAWQ's own key names
            stored = {
                "bits": stored["w_bit"], "group_size": stored.get("q_group_size"),
                "zero_point": stored.get("zero_point", True), "version": stored.get("version", "gemm"),
                "modules_to_not_convert": stored.get("modules_to_not_convert"),
            }  # fmt: skip
        return {"quant_method": method, **stored}
    return None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, shard) for shard in shards]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    return [os.path.join(path, f) for f in files]


def iter_safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    files = safetensors_files(path)
    if not files:
        raise ValueError(
            f"model {path!r} has no *.safetensors weights (use load_format='dummy' for random weights)."
        )
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"cannot read weights file {file!r}: {exc}") from exc


def load_hf_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {path!r} ({exc}); pass skip_tokenizer_init=True "
            "to work with token ids only."
        ) from exc


def generation_eos_ids(path: str) -> list[int]:
    """EOS ids from generation_config.json, which instruct models often extend (e.g. Llama 3's <|eot_id|>)."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.exists(file):
        return []
    with open(file) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]


# sentence-transformers Pooling config flags, and the pooling each one means here.
_ST_POOLING_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
}


def sentence_transformers_pooling(path: str) -> str | None:
    """The pooling named by a sentence-transformers checkpoint (modules.json points at its Pooling
    module's folder, whose config.json sets one pooling_mode_* flag), or None without one."""
    modules_file = os.path.join(path, "modules.json")
    if not os.path.isfile(modules_file):
        return None
    with open(modules_file) as f:
        modules = json.load(f)
    for module in modules:
        if not str(module.get("type", "")).endswith("Pooling"):
            continue
        config_file = os.path.join(path, module.get("path", ""), "config.json")
        if not os.path.isfile(config_file):
            return None
        with open(config_file) as f:
            config = json.load(f)
        for flag, pooling in _ST_POOLING_MODES.items():
            if config.get(flag):
                return pooling
    return None
