"""tokenmill's Llama-family model (dense and mixture-of-experts) against transformers' own, on random
weights of odd shapes: prefill logits, and greedy tokens however the engine batches, chunks, caches or
preempts."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ARCHS, MOE_ARCHS
from tokenmill import LLM, SamplingParams
from tokenmill.core.request import Request

NUM_NEW_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def random_prompts(lengths: list[int], seed: int = 1, prefix: list[int] | None = None) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, 1003, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], num_tokens: int = NUM_NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


PROMPTS = random_prompts([5, 17, 33, 2])
ALL_ARCHS = ARCHS + MOE_ARCHS


@pytest.fixture(scope="module")
def references(hf_model_dirs):
    """arch -> greedy continuations of PROMPTS by transformers."""
    return {arch: [hf_greedy(hf_model_dirs[arch][1], p) for p in PROMPTS] for arch in ALL_ARCHS}


def make_llm(path: str, **options) -> LLM:
    options.setdefault("max_model_len", 256)
    options.setdefault("dtype", "float32")
    return LLM(model=path, skip_tokenizer_init=True, **options)


def generate_ids(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_prefill_logits_match_transformers(arch, hf_model_dirs):
    path, hf_model = hf_model_dirs[arch]
    llm = make_llm(path, block_size=16)
    engine = llm.engine
    prompts = random_prompts([7, 40], seed=3)
    for i, prompt in enumerate(prompts):
        engine.core.add_request(Request(str(i), prompt, GREEDY))
    scheduled = engine.scheduler.schedule()
    assert list(scheduled.num_scheduled_tokens.values()) == [len(p) for p in prompts]
    runner = engine.runner
    runner.input_batch.update_states(scheduled)
    with torch.inference_mode():
        input_ids, positions, md = runner.to_device(runner.input_batch.prepare(scheduled))
        logits = runner.model.compute_logits(runner.model(input_ids, positions, md))
        expected = torch.cat([hf_model(torch.tensor([p])).logits[0] for p in prompts])
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_batched_matches_transformers(arch, hf_model_dirs, references):
    llm = make_llm(hf_model_dirs[arch][0])
    assert generate_ids(llm, PROMPTS) == references[arch]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_one_at_a_time(arch, hf_model_dirs, references):
    llm = make_llm(hf_model_dirs[arch][0], max_num_seqs=1)
    assert [generate_ids(llm, [p])[0] for p in PROMPTS] == references[arch]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_with_chunked_prefill(arch, hf_model_dirs, references):
    # A budget of 7 tokens splits every prompt but the shortest across several steps,
    # and mixes prompt chunks with other requests' decodes in one step.
    llm = make_llm(hf_model_dirs[arch][0], max_num_batched_tokens=7, block_size=4)
    assert generate_ids(llm, PROMPTS) == references[arch]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_with_prefix_cache_hits(arch, hf_model_dirs):
    path, hf_model = hf_model_dirs[arch]
    shared = random_prompts([48], seed=5)[0]
    prompts = random_prompts([3, 11], seed=6, prefix=shared)
    llm = make_llm(path, block_size=16)
    kv = llm.engine.scheduler.kv
    first = generate_ids(llm, [prompts[0]])
    assert kv.prefix_cache_hits == 0
    second = generate_ids(llm, [prompts[1]])
    # The 48 shared tokens are three full blocks, all served from the cache.
    assert kv.prefix_cache_hits == 48
    outputs = llm.generate(prompt_token_ids=[prompts[1]], sampling_params=GREEDY, use_tqdm=False)
    assert outputs[0].num_cached_tokens == 48  # the same prompt again: capped by the block boundary
    assert [first[0], second[0]] == [hf_greedy(hf_model, p) for p in prompts]


@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_greedy_under_preemption(arch, hf_model_dirs, references):
    # Each request needs up to 17 blocks of 4 tokens; 24 blocks cannot hold four of them at once.
    llm = make_llm(hf_model_dirs[arch][0], block_size=4, num_kv_blocks=24, max_model_len=72)
    assert generate_ids(llm, PROMPTS) == references[arch]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.kv.pool.num_free_blocks == 24


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_the_configs_activation(hidden_act, tmp_path):
    """hidden_act other than SiLU (the family's own) runs as transformers computes it."""
    from tests.conftest import make_hf_model

    hf_model = make_hf_model("qwen2", hidden_act=hidden_act)
    hf_model.save_pretrained(tmp_path)
    got = generate_ids(make_llm(str(tmp_path)), PROMPTS)
    assert got == [hf_greedy(hf_model, p) for p in PROMPTS]


def test_an_unknown_activation_is_refused_by_name(tmp_path):
    from tests.conftest import make_hf_model

    make_hf_model("llama", hidden_act="quick_gelu").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        make_llm(str(tmp_path))
