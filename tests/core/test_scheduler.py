"""Scheduler and KV cache accounting with no model at all: a fake executor samples token 7 every time."""

from __future__ import annotations

import random

import pytest

from tokenmill.core.engine import EngineCore
from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.outputs import ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


class FakeExecutor:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.steps: list[SchedulerOutput] = []

    def prepare(self, scheduler_output: SchedulerOutput) -> SchedulerOutput:
        return scheduler_output

    def launch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute(scheduler_output)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(scheduler_output)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for request_id in req_ids:
            request = self.scheduler.requests[request_id]
            # Every slot the step writes must be allocated to the request (computed counts are advanced
            # when the step is scheduled).
            assert request.num_computed_tokens <= len(request.block_ids) * 4
            samples = request.num_computed_tokens + 1 == request.num_tokens_with_placeholders
            sampled.append([7] if samples else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def make_core(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=32,
    max_model_len=256,
    caching=True,
    async_scheduling=False,
    context_cost=0.0,
    prefill_cap=None,
):
    kv = KVCacheManager(num_blocks, block_size, caching)
    scheduler = Scheduler(kv, max_num_seqs, budget, max_model_len, context_cost, prefill_cap)
    executor = FakeExecutor(scheduler)
    return EngineCore(scheduler, executor, async_scheduling=async_scheduling), executor


def request(rid: str, prompt_len: int, max_tokens: int = 5, **kwargs) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens), **kwargs)


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return tokens
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_token_budget_and_seq_cap_are_respected(async_scheduling):
    core, executor = make_core(budget=10, max_num_seqs=3, async_scheduling=async_scheduling)
    for i in range(6):
        core.add_request(request(str(i), prompt_len=13))
    tokens = run_to_completion(core)
    assert sorted(tokens) == [str(i) for i in range(6)] and all(len(t) == 5 for t in tokens.values())
    for step in executor.steps:
        assert step.total_num_scheduled_tokens <= 10
        assert sum(step.num_scheduled_tokens.values()) == step.total_num_scheduled_tokens
        assert len(step.num_scheduled_tokens) <= 3
    # The 13-token prompts cannot fit a 10-token budget: the first step is a chunk.
    assert list(executor.steps[0].num_scheduled_tokens.items()) == [("0", 10)]


def test_running_requests_first_and_prefills_share_steps_with_decodes():
    core, executor = make_core(budget=8)
    core.add_request(request("a", prompt_len=3, max_tokens=4))
    core.step()
    core.add_request(request("b", prompt_len=20, max_tokens=2))
    core.step()
    step = executor.steps[1]
    assert list(step.num_scheduled_tokens.items()) == [("a", 1), ("b", 7)]


def test_blocks_freed_on_finish_and_abort():
    core, _ = make_core(num_blocks=20)
    kv = core.scheduler.kv
    core.add_request(request("done", prompt_len=9, max_tokens=2))
    core.add_request(request("cut", prompt_len=9, max_tokens=50))
    core.step()
    assert kv.pool.num_free_blocks == 20 - 3 - 3
    core.step()  # "done" finishes
    assert "done" not in core.scheduler.requests
    core.abort_requests(["cut"])
    assert kv.pool.num_free_blocks == 20
    assert not core.has_unfinished_requests()
    assert core.scheduler.num_running == 0 and core.scheduler.num_waiting == 0


def test_abort_while_waiting():
    core, _ = make_core(max_num_seqs=1)
    core.add_request(request("a", prompt_len=4))
    core.add_request(request("b", prompt_len=4))
    core.step()
    core.abort_requests(["b"])
    assert core.scheduler.num_waiting == 0
    assert set(run_to_completion(core)) == {"a"}


def test_preempts_newest_and_recomputes():
    # Two requests growing to 24 tokens need 6 blocks each; 9 blocks force one out.
    core, executor = make_core(num_blocks=9, budget=64, max_model_len=64)
    core.add_request(request("old", prompt_len=8, max_tokens=16, arrival_time=1.0))
    core.add_request(request("new", prompt_len=8, max_tokens=16, arrival_time=2.0))
    tokens = run_to_completion(core)
    assert tokens == {"old": [7] * 16, "new": [7] * 16}
    preempted = [rid for step in executor.steps for rid in step.preempted_req_ids]
    assert preempted and set(preempted) == {"new"}
    assert core.scheduler.kv.pool.num_free_blocks == 9


def test_priority_orders_admission():
    core, executor = make_core(max_num_seqs=1)
    core.add_request(request("low", prompt_len=4, max_tokens=1, priority=5, arrival_time=1.0))
    core.add_request(request("high", prompt_len=4, max_tokens=1, priority=0, arrival_time=2.0))
    run_to_completion(core)
    assert [next(iter(s.num_scheduled_tokens)) for s in executor.steps] == ["high", "low"]


def test_prefix_cache_hits_counted_in_tokens():
    core, _ = make_core(block_size=4)
    kv = core.scheduler.kv
    core.add_request(request("a", prompt_len=10, max_tokens=1))
    run_to_completion(core)
    b = request("b", prompt_len=10, max_tokens=1)
    core.add_request(b)
    core.step()
    assert b.num_cached_tokens == 8  # two full blocks; the last partial block is recomputed
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 20


def test_cache_salt_isolates_prefixes():
    core, _ = make_core(block_size=4)
    core.add_request(request("a", prompt_len=10, max_tokens=1, cache_salt="tenant-1"))
    run_to_completion(core)
    b = request("b", prompt_len=10, max_tokens=1, cache_salt="tenant-2")
    core.add_request(b)
    core.step()
    assert b.num_cached_tokens == 0


def test_stop_conditions():
    core, _ = make_core()
    eos = Request("eos", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_ids=(7,))
    min_tok = Request("min", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=3), eos_token_ids=(7,))
    ignore = Request("ign", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), eos_token_ids=(7,))
    stop_id = Request("sid", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[7]))
    for r in (eos, min_tok, ignore, stop_id):
        core.add_request(r)
    tokens = run_to_completion(core)
    assert {k: len(v) for k, v in tokens.items()} == {"eos": 1, "min": 3, "ign": 4, "sid": 1}
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert ignore.status == RequestStatus.FINISHED_LENGTH
    assert stop_id.stop_reason == 7


def test_max_model_len_caps_output():
    core, _ = make_core(max_model_len=12)
    r = Request("r", list(range(10)), SamplingParams(max_tokens=None))
    core.add_request(r)
    assert len(run_to_completion(core)["r"]) == 2
    assert r.status == RequestStatus.FINISHED_LENGTH


def test_duplicate_request_id_rejected():
    core, _ = make_core()
    core.add_request(request("x", 3))
    with pytest.raises(ValueError, match="request_id"):
        core.add_request(request("x", 3))


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefill_cap", [None, 5])
@pytest.mark.parametrize("caching", [True, False])
def test_no_leak_after_random_traffic(caching, prefill_cap, async_scheduling):
    rng = random.Random(0)
    core, executor = make_core(
        num_blocks=40,
        block_size=4,
        max_num_seqs=6,
        budget=24,
        caching=caching,
        async_scheduling=async_scheduling,
        prefill_cap=prefill_cap,
    )
    produced: dict[str, int] = {}
    limits: dict[str, int] = {}
    kv = core.scheduler.kv
    live: list[str] = []
    prefixes = [list(range(1000 + 16 * i, 1016 + 16 * i)) for i in range(3)]
    for step in range(3000):
        action = rng.random()
        if action < 0.3:
            rid = f"r{step}"
            prompt = rng.choice(prefixes)[: rng.randint(0, 16)] + [
                rng.randint(0, 99) for _ in range(rng.randint(1, 30))
            ]
            limits[rid] = rng.randint(1, 20)
            core.add_request(Request(rid, prompt, SamplingParams(max_tokens=limits[rid]), arrival_time=step))
            live.append(rid)
        elif action < 0.4 and live:
            core.abort_requests([live.pop(rng.randrange(len(live)))])
        for out in core.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
            assert out.request_id in live  # nothing reaches the caller after a finish or an abort
            if out.finish_reason is not None:
                live.remove(out.request_id)
                assert produced[out.request_id] == limits[out.request_id]
        held = sum(len(r.block_ids) for r in core.scheduler.requests.values())
        refs = sum(b.ref_cnt for b in kv.pool.blocks)
        assert held == refs  # every reference is owned by a live request
        assert kv.pool.num_free_blocks + sum(1 for b in kv.pool.blocks if b.ref_cnt > 0) == 40
    core.abort_requests(list(core.scheduler.requests))
    assert core.step() == []  # a step still in flight returns, and its tokens are dropped
    assert kv.pool.num_free_blocks == 40
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not core.has_unfinished_requests()


def test_empty_step_carries_finished_and_preempted_ids_to_the_next_real_step():
    core, executor = make_core()
    core.add_request(request("a", prompt_len=3, max_tokens=1))
    run_to_completion(core)
    assert core.scheduler.schedule().is_empty  # nothing to run: the news of "a" must not be lost
    core.add_request(request("b", prompt_len=3, max_tokens=1))
    run_to_completion(core)
    assert executor.steps[-1].finished_req_ids == ["a"]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_token_at_the_last_allowed_position_is_a_stop(async_scheduling):
    core, _ = make_core(async_scheduling=async_scheduling)
    # The fake executor always samples 7: as EOS, as a stop token id, and as a plain token.
    core.add_request(Request("eos", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_ids=(7,)))
    core.add_request(Request("stop", [1, 2, 3], SamplingParams(max_tokens=1, stop_token_ids=[7])))
    core.add_request(Request("plain", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_ids=(9,)))
    reasons = {}
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finish_reason is not None:
                reasons[out.request_id] = (out.finish_reason, out.stop_reason)
    assert reasons == {"eos": ("stop", None), "stop": ("stop", 7), "plain": ("length", None)}


def test_a_long_prompt_leaves_room_for_a_newcomer_and_takes_back_what_it_leaves():
    core, executor = make_core(budget=16, num_blocks=128)
    core.add_request(request("long", prompt_len=200, max_tokens=1))
    core.step()
    assert executor.steps[-1].num_scheduled_tokens == {"long": 16}  # alone: the whole budget
    core.add_request(request("short", prompt_len=3, max_tokens=1))
    core.step()
    # The newcomer gets its whole prompt in; the long prompt gets the rest of the step, not just half.
    assert executor.steps[-1].num_scheduled_tokens == {"long": 13, "short": 3}
    core.add_request(request("big", prompt_len=40, max_tokens=1))
    core.step()
    # Two prompts in one step: the long one is held to half, the newcomer takes the other half.
    assert executor.steps[-1].num_scheduled_tokens == {"long": 8, "big": 8}
    core.step()  # "big" is running now and nobody waits: running chunks fill the budget in order
    assert executor.steps[-1].num_scheduled_tokens == {"long": 16}
    assert sorted(run_to_completion(core)) == ["big", "long"]


def test_no_room_is_held_back_when_no_seat_is_free():
    core, executor = make_core(budget=16, num_blocks=128, max_num_seqs=1)
    core.add_request(request("long", prompt_len=100, max_tokens=1))
    core.step()
    core.add_request(request("next", prompt_len=3, max_tokens=1))
    core.step()
    assert executor.steps[-1].num_scheduled_tokens == {"long": 16}


def test_chunks_deep_into_a_long_prompt_are_shorter_when_attention_is_counted():
    # Attending to 100 earlier tokens costs as much as a token's own matmuls.
    core, executor = make_core(budget=64, num_blocks=256, max_model_len=1024, context_cost=0.01)
    core.add_request(request("long", prompt_len=600, max_tokens=2))
    run_to_completion(core)
    chunks = [step.num_scheduled_tokens["long"] for step in executor.steps]
    assert sum(chunks[:-1]) == 600 and chunks[-1] == 1  # the prompt, then one decode step
    assert chunks[0] > chunks[len(chunks) // 2] > chunks[-2] >= 1
    start = 0
    for num in chunks[:-1]:  # every chunk's cost (tokens plus attention) fits the budget
        assert num + 0.01 * num * (start + num / 2) <= 64
        start += num


def test_decode_tokens_cost_one_whatever_their_context():
    core, executor = make_core(budget=8, max_num_seqs=8, num_blocks=256, context_cost=0.5)
    for i in range(8):
        core.add_request(request(str(i), prompt_len=1, max_tokens=3))
    run_to_completion(core)
    assert max(len(step.num_scheduled_tokens) for step in executor.steps) == 8


def test_prompts_beside_decodes_take_at_most_the_prefill_cap():
    core, executor = make_core(budget=32, num_blocks=128, max_num_seqs=8, prefill_cap=6, caching=False)
    for rid in ("a", "b", "c"):  # alone, prompts take the whole budget: all three in one step
        core.add_request(request(rid, prompt_len=10, max_tokens=20))
    core.step()
    assert executor.steps[-1].num_scheduled_tokens == {"a": 10, "b": 10, "c": 10}
    core.add_request(request("d", prompt_len=9, max_tokens=3))
    core.add_request(request("e", prompt_len=4, max_tokens=3))
    core.step()
    # Three decodes run: the newcomers' prompts share 6 tokens, in arrival order.
    assert executor.steps[-1].num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 6}
    core.step()
    assert executor.steps[-1].num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 3, "e": 3}
    core.step()
    assert executor.steps[-1].num_scheduled_tokens == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1}
    assert sorted(run_to_completion(core)) == ["a", "b", "c", "d", "e"]
    for step in executor.steps:
        decoding = [n for n in step.num_scheduled_tokens.values() if n == 1]
        prompt_tokens = sum(n for n in step.num_scheduled_tokens.values() if n > 1)
        assert not decoding or prompt_tokens <= 6
