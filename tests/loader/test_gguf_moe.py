"""Mixture-of-experts GGUF files (qwen3moe, and Mixtral written as "llama" with expert stacks) run in the
engine as the transformers model they were written from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from tokenmill import LLM, SamplingParams
from tokenmill.loader.gguf import load_gguf_config

WriteGGUF = Callable[..., None]  # conftest.write_gguf

TINY = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY |= dict(max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
CASES = {
    "qwen3moe": (
        gguf.MODEL_ARCH.QWEN3MOE,
        Qwen3MoeConfig(
            **TINY, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True, head_dim=16, architectures=["Qwen3MoeForCausalLM"],
        ),
    ),
    "mixtral": (
        gguf.MODEL_ARCH.LLAMA,
        MixtralConfig(
            **TINY, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
            architectures=["MixtralForCausalLM"],
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_moe_gguf_greedy_matches_transformers(tmp_path: Path, write_gguf: WriteGGUF, case: str) -> None:
    arch, hf_config = CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # weights large enough that greedy decoding wanders, and routing matters
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5 if parameter.dim() > 1 else 1.0)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, model, arch)

    config = load_gguf_config(str(path))
    assert type(config) is type(hf_config)
    assert config.num_experts_per_tok == 2
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    prompt = [5, 17, 200, 42, 9]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    output = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, min_new_tokens=8,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
    assert output.outputs[0].token_ids == expected
