"""Async scheduling changes when the host plans a step, never what a user sees: the same tokens, finish
reasons and texts as the synchronous loop, with stop strings, n > 1, aborts mid-run and preemption."""

from __future__ import annotations

import pytest

from tests.conftest import ARCHS
from tests.models.test_llama_equivalence import make_llm, random_prompts
from tokenmill import LLM, SamplingParams


def run(llm: LLM, prompts, params, abort_at_step: int | None = None) -> dict[str, list]:
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [(o.token_ids, o.finish_reason, o.text) for o in out.outputs]
        steps += 1
        if steps == abort_at_step:
            engine.abort_request("0")
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.num_blocks
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_async_equals_sync_on_every_architecture(arch, hf_model_dirs):
    prompts = random_prompts([5, 30, 17, 44, 9, 2], seed=2)
    params = [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.9, seed=5, n=3, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, min_tokens=3),
    ]
    engine_args = dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=20, max_model_len=96)
    sync = make_llm(hf_model_dirs[arch][0], **engine_args)
    expected = run(sync, prompts, params, abort_at_step=4)
    # Stop on a token each request is known to produce (its 6th), so stops land mid-stream (not under
    # min_tokens, which bans stop tokens and so changes the greedy path).
    stops = {
        i: r[0][0][5]
        for i, r in ((int(k), v) for k, v in expected.items())
        if len(r[0][0]) > 6 and params[i].min_tokens == 0
    }
    stopped = [
        p if i not in stops else SamplingParams(**{**p.__dict__, "stop_token_ids": [stops[i]]})
        for i, p in enumerate(params)
    ]
    with_stops = {}
    for async_scheduling in (False, True):
        llm = make_llm(hf_model_dirs[arch][0], **engine_args, async_scheduling=async_scheduling)
        assert llm.engine.core.async_scheduling is async_scheduling
        assert run(llm, prompts, params, abort_at_step=4) == expected
        assert llm.engine.scheduler.num_preemptions > 0
        with_stops[async_scheduling] = run(llm, prompts, stopped)
    assert with_stops[True] == with_stops[False]
    for i in stops:
        tokens, reason, _ = with_stops[False][str(i)][0]
        assert reason == "stop" and tokens[-1] == stops[i] and len(tokens) <= 6


def test_async_equals_sync_with_stop_strings_on_smollm2():
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):", "1, 2, 3, 4,"]
    params = [
        SamplingParams(temperature=0, max_tokens=40, stop=[" was"]),
        SamplingParams(temperature=0, max_tokens=40, stop=["\n"]),
        SamplingParams(temperature=0, max_tokens=40, stop=["return"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, stop=[" 7,"], n=2),
    ]
    results = []
    for async_scheduling in (False, True):
        llm = LLM(dtype="float32", async_scheduling=async_scheduling, max_num_batched_tokens=16)
        results.append(run(llm, prompts, params))
    assert results[0] == results[1]
    assert results[0]["0"][0][1] == "stop" and results[0]["3"][0][2].endswith(" 6,")
