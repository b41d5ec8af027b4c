"""Public model shapes (from their Hugging Face config.json files) for dummy-weight benchmarks."""

from __future__ import annotations

import json
import os
import tempfile

SHAPES = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
}


def shape_dir(name: str, **overrides) -> str:
    """A directory holding only config.json: enough for load_format='dummy'."""
    path = tempfile.mkdtemp(prefix=f"tokenmill-{name}-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**SHAPES[name], **overrides}, f)
    return path


def decode_weight_bytes(name: str, bytes_per_param: int = 2) -> int:
    """Bytes one decode step must read: every weight except an untied input embedding table,
    of which a step gathers one row per sequence."""
    c = SHAPES[name]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter + 2 * h
    if c["model_type"] == "qwen3":
        per_layer += 2 * c["head_dim"]
    params = layers * per_layer + h + c["vocab_size"] * h  # final norm + lm_head
    return params * bytes_per_param


def kv_bytes_per_token(name: str, bytes_per_elem: int = 2) -> int:
    c = SHAPES[name]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * bytes_per_elem


def prefill_flops(name: str, num_tokens: int) -> float:
    """Matmul FLOPs of a prefill (logits for the last token only) plus causal attention."""
    c = SHAPES[name]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q = c["num_attention_heads"] * c["head_dim"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    attention = layers * 2 * num_tokens * num_tokens * q  # QK^T and PV over the causal half
    return 2.0 * linear * num_tokens + attention + 2.0 * c["vocab_size"] * h
