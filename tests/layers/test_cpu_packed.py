"""bf16 linears on a CPU with oneDNN-packed weights: the same log-probabilities as F.linear on the plain
weights, a tied LM head packed as a copy (the embedding keeps its plain table), fp32 left alone."""

from __future__ import annotations

import pytest
import torch
import transformers

from tokenmill import LLM, SamplingParams
from tokenmill.layers.cpu_packed import CpuPackedLinearMethod, _ops_available
from tokenmill.layers.linear import LinearBase

pytestmark = pytest.mark.skipif(not _ops_available(), reason="this torch has no oneDNN linear ops")
PROMPT = [3, 17, 250, 9, 41, 77, 128, 5, 64, 200, 33, 1]


def checkpoint(path, tied: bool) -> str:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def logprobs(llm: LLM) -> list[float]:
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, logprobs=1)
    (out,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=params, use_tqdm=False)
    prompt = [entry[t].logprob for t, entry in zip(PROMPT[1:], out.prompt_logprobs[1:])]
    return prompt + [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]


@pytest.mark.parametrize("tied", [False, True])
def test_packed_bf16_linears_match_plain_ones(tied: bool, tmp_path, monkeypatch) -> None:
    path = checkpoint(tmp_path / "model", tied)
    options = dict(skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=16, max_model_len=64)
    packed = LLM(path, **options)
    model = packed.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(isinstance(m.quant_method, CpuPackedLinearMethod) for m in linears)
    assert all(m.weight.is_mkldnn for m in linears)
    assert model.lm_head.packed_weight.is_mkldnn
    assert not model.model.embed_tokens.weight.is_mkldnn  # the table is gathered, never packed
    monkeypatch.setattr("tokenmill.worker.model_loader.pack_cpu_linears", lambda *args: 0)
    plain = LLM(path, **options)
    plain_linears = [m for m in plain.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert not any(m.weight.is_mkldnn for m in plain_linears)
    got, want = torch.tensor(logprobs(packed)), torch.tensor(logprobs(plain))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_fp32_is_left_to_f_linear(tmp_path) -> None:
    path = checkpoint(tmp_path / "model", tied=False)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16, max_model_len=64)
    model = llm.engine.runner.model
    assert not any(m.weight.is_mkldnn for m in model.modules() if isinstance(m, LinearBase))
    assert getattr(model.lm_head, "packed_weight", None) is None
