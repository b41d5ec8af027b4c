"""Hugging Face model directories: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch


def load_hf_config(path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise ValueError(f"model {path!r}: cannot read config.json ({exc}).") from exc


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
