"""Prompt logprobs: every prompt token scored as transformers scores it, however the prompt is chunked,
cached or recomputed."""

from __future__ import annotations

import pytest
import torch

from tests.models.test_llama_equivalence import make_llm, random_prompts
from tokenmill import SamplingParams

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)


def expected_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def check(output, hf_model) -> None:
    prompt = output.prompt_token_ids
    reference = expected_logprobs(hf_model, prompt)
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        token = prompt[position]
        row = reference[position - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert set(row.topk(3).indices.tolist()) <= set(entry)  # the top-3 alternatives ride along


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logprobs_match_transformers_across_chunks(arch, hf_model_dirs):
    path, hf_model = hf_model_dirs[arch]
    llm = make_llm(path, max_num_batched_tokens=7, block_size=4)
    prompts = random_prompts([9, 30], seed=11)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False)
    for output in outputs:
        check(output, hf_model)


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_preemption(hf_model_dirs):
    path, hf_model = hf_model_dirs["llama"]
    prompts = random_prompts([40, 41], seed=12)
    llm = make_llm(path, block_size=4, num_kv_blocks=24, max_model_len=72)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for output in outputs:
        check(output, hf_model)
    again = llm.generate(prompt_token_ids=prompts[:1], sampling_params=PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check(again, hf_model)


def test_no_prompt_logprobs_unless_asked(hf_model_dirs):
    llm = make_llm(hf_model_dirs["qwen2"][0])
    output = llm.generate(
        prompt_token_ids=random_prompts([5]), sampling_params=SamplingParams(max_tokens=2), use_tqdm=False
    )[0]
    assert output.prompt_logprobs is None
