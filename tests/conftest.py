"""Shared fixtures: small random-weight models built with transformers' own classes, saved to disk."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the kernel tests run Triton's interpreter, which must be chosen before anything imports
# triton.language: its own @jit functions (tl.zeros, ...) are made for the interpreter or not as it
# imports. A library a test module imports at collection can import it first (nvidia-modelopt does, in
# tests collected before tests/kernels), so it is chosen here, before any test module; tests/kernels'
# conftest mends the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Odd sizes on purpose: head_dim not a power of two, GQA ratios 1, 3 and 4, vocab not a power of two.
ARCH_CONFIGS = {
    "llama": dict(
        cls="LlamaConfig",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=48,
        intermediate_size=200,
        attention_bias=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        rope_theta=500000.0,
    ),
    "mistral": dict(
        cls="MistralConfig",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=176,
        sliding_window=None,
    ),
    "qwen2": dict(
        cls="Qwen2Config",
        hidden_size=80,
        num_attention_heads=5,
        num_key_value_heads=5,
        intermediate_size=150,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        cls="Qwen3Config",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=40,
        intermediate_size=136,
        tie_word_embeddings=False,
    ),
    # Mixture of experts: an odd number of experts, top-3, a dense layer beside a sparse one (Qwen3-MoE's
    # mlp_only_layers), routing weights renormalised (Mixtral) and not (this Qwen3-MoE).
    "qwen3_moe": dict(
        cls="Qwen3MoeConfig",
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=40,
        intermediate_size=136,
        moe_intermediate_size=56,
        num_experts=7,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "mixtral": dict(
        cls="MixtralConfig",
        hidden_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=72,
        num_local_experts=5,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
    # For expert parallelism over two ranks: an even number of experts.
    "mixtral_ep": dict(
        cls="MixtralConfig",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=40,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=None,
    ),
}
MOE_ARCHS = ["qwen3_moe", "mixtral"]
ARCHS = [
    arch for arch in ARCH_CONFIGS if arch not in MOE_ARCHS + ["mixtral_ep"]
]  # dense: every path runs them


def make_hf_model(arch: str, seed: int = 0, **overrides):
    import transformers

    spec = {**ARCH_CONFIGS[arch], **overrides}
    config_cls = getattr(transformers, spec.pop("cls"))
    config = config_cls(
        vocab_size=1003,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        initializer_range=0.2,
        **spec,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # random norm weights too, so the norm code is exercised
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory):
    """arch -> (saved model directory, transformers model in fp32)."""
    models = {}
    for arch in ARCH_CONFIGS:
        path = tmp_path_factory.mktemp(f"{arch}_model")
        model = make_hf_model(arch)
        model.save_pretrained(path)
        models[arch] = (str(path), model)
    return models


@pytest.fixture(scope="session")
def llama_head_dim_64_dir(tmp_path_factory) -> str:
    """A saved random Llama whose heads are 64 wide: a head size the CUDA FP8 decode takes (64 and 128),
    which the odd-sized models above are not, so that engine tests on a GPU run it."""
    path = tmp_path_factory.mktemp("llama_hd64_model")
    make_hf_model("llama", head_dim=64).save_pretrained(path)
    return str(path)


_GGUF_READERS: dict = {}


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers' GGUF loading parses the file's metadata at each step (config, tokenizer, weights: ~4 s
    each for SmolLM2's 49k-token vocabulary) and builds gguf's tensor-name map once per tensor (~5 s).
    Inside this block the gguf package hands transformers one parsed reader a file (read-only: a memory
    map and its fields) and one name map per (architecture, layers): the same objects it would build, so
    the reference is still transformers' own load, in about half the time."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, mode="r"):
        key = (os.path.abspath(path), mode)
        if key not in _GGUF_READERS:
            _GGUF_READERS[key] = reader_class(path, mode)
        return _GGUF_READERS[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


@pytest.fixture(scope="session")
def transformers_gguf_tokenizer():
    """transformers' own GGUF load of the embedded SmolLM2 tokenizer, shared: the GGUF tests and the
    offline LLM's greedy test both compare with it, and it takes seconds to convert."""
    from transformers import AutoTokenizer

    from tokenmill.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    with _gguf_parsed_once():
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def transformers_gguf_model():
    """transformers' own GGUF load of the embedded SmolLM2 (fp32, eval mode), shared read-only by the GGUF
    loader's tests and the offline LLM's greedy test: dequantizing it takes about ten seconds a load."""
    from transformers import AutoModelForCausalLM

    from tokenmill.loader.default_model import default_model_path

    folder, name = os.path.split(default_model_path())
    with _gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
