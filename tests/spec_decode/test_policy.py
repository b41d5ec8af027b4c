"""Dynamic speculation by batch size (spec_decode/policy.py): the planner's verify cost against a running
tau decides each step; probes re-measure tau where verifying is nearly free; the engine follows it."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from tests.models.test_llama_equivalence import make_llm, random_prompts
from tests.serving.test_async_scheduling import run
from tests.spec_decode.test_spec_engine import NGRAM
from tokenmill import SamplingParams
from tokenmill.spec_decode import ReplayProposer
from tokenmill.spec_decode.policy import MARGIN, PROBE_INTERVAL, BatchLimit, batch_limit_for

# Cost 1 up to batch 4, then growing by 0.5 a batch: a small card.
COSTS = {1024: [1.0] * 4 + [1.0 + 0.5 * i for i in range(1, 29)]}


def test_limit_follows_tau_and_probes_announce_themselves() -> None:
    policy = BatchLimit(COSTS, num_speculative_tokens=4, draft_cost=0.0)
    assert policy.tau == pytest.approx(1.9375)  # acceptance 0.5 to start
    assert policy.limit(1000) == 6  # 1.9375 >= 1.05 * 1.5, not 1.05 * 2.0
    for _ in range(30):
        policy.observe(1.0)  # nothing accepted
    assert policy.tau < MARGIN and policy.limit(1000) == 1
    # Off where verifying costs more than MARGIN: never probes; where it is nearly free, one step in
    # PROBE_INTERVAL verifies and the step before it proposes.
    assert [policy.speculates(8, 1000) for _ in range(40)] == [(False, False)] * 40
    decisions = [policy.speculates(2, 1000) for _ in range(2 * PROBE_INTERVAL)]
    assert [i for i, (verify, _) in enumerate(decisions) if verify] == [15, 31]
    assert [i for i, (_, propose) in enumerate(decisions) if propose] == [14, 30]
    for _ in range(60):
        policy.observe(5.0)  # every draft accepted
    assert policy.tau == pytest.approx(5.0, abs=0.01)
    assert policy.speculates(8, 1000) == (True, True)
    assert policy.limit(1000) == 12  # 1.05 * 4.5 <= 5 at batch 11; 1.05 * 5.0 > 5 at 12


def test_draft_cost_raises_the_bar() -> None:
    free = BatchLimit(COSTS, 3, draft_cost=0.0)
    dear = BatchLimit(COSTS, 3, draft_cost=0.4)
    free.tau = dear.tau = 2.0
    assert free.limit(1000) > dear.limit(1000) == 1  # 2.0 < 1.05 * (1 + 3 * 0.4)


def test_planner_costs_for_an_8b_on_an_h200() -> None:
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
    policy = batch_limit_for(config, "NVIDIA H200", 4, 0.0, 256, 8192)
    costs = policy._costs(300)
    assert costs[0] == pytest.approx(1.0, abs=0.02)  # batch 1: the weights' read, either way
    assert costs[127] > 1.5  # batch 128 x 5 tokens: compute-bound
    assert policy._costs(4096)[127] < costs[127]  # longer context: the KV read keeps it cheaper
    limits = []
    for tau in (1.2, 2.0, 3.0):
        policy.tau = tau
        limits.append(policy.limit(300))
    assert 16 < limits[0] < limits[1] < limits[2]
    assert batch_limit_for(config, "a card nobody knows", 4, 0.0, 256, 8192) is None


def test_the_engine_stops_speculating_when_drafts_do_not_pay(hf_model_dirs) -> None:
    """A policy set on a CPU engine (verifying free up to batch 8): drafts all wrong stop after a few
    steps but for probes; drafts all right go on every step; greedy output is the plain engine's."""
    target = hf_model_dirs["llama"][0]
    engine_args = dict(block_size=4, max_model_len=128, max_num_batched_tokens=64)
    prompts = random_prompts([9, 20, 14, 11, 30, 7], seed=3)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts)
    expected = run(make_llm(target, **engine_args), prompts, params)

    def speculative():
        llm = make_llm(target, **engine_args, speculative_config=NGRAM)
        costs = {1024: [1.0] * 8 + [1.0 + 0.5 * i for i in range(1, 25)]}
        llm.engine.scheduler.spec.policy = BatchLimit(costs, 4, 0.0)
        return llm

    recorded = [(p, expected[str(i)][0][0]) for i, p in enumerate(prompts)]
    spec = speculative()
    spec.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=1.0)  # all wrong
    assert run(spec, prompts, params) == expected
    scheduler = spec.engine.scheduler
    assert scheduler.spec.policy.tau < 1.2
    # Verifying requests: the first steps' until tau falls (~12), then one probing step in 16 (of ~40).
    assert 0 < scheduler.spec.num_drafts < 6 * 16

    replay = speculative()
    replay.engine.runner.drafter.proposer = ReplayProposer(recorded, 4)
    assert run(replay, prompts, params) == expected
    assert replay.engine.scheduler.spec.policy.tau > 4
    assert replay.engine.scheduler.spec.num_accepted_tokens > 100


def test_the_policy_plans_the_weights_and_kv_cache_as_the_engine_holds_them() -> None:
    """An FP8 KV cache reads half the bytes a token: verification stays cheaper against it at long
    context; the engine names its weights' dtype from the loaded linears' bytes, however quantized."""
    from tokenmill import LLM
    from tokenmill.serving.engine_setup import _stored_as

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)  # fmt: skip
    bf16 = batch_limit_for(config, "NVIDIA H200", 4, 0.0, 256, 32768)
    fp8 = batch_limit_for(config, "NVIDIA H200", 4, 0.0, 256, 32768, weight_dtype="fp8", kv_dtype="fp8")
    assert fp8._costs(32768)[63] != bf16._costs(32768)[63]
    for quantization, expected in ((None, "bf16"), ("fp8", "fp8"), ("int4", "int4")):
        llm = LLM("default", quantization=quantization, max_model_len=256, num_kv_blocks=16)
        assert _stored_as(llm.engine.runner.model) == expected
