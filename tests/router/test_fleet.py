"""The simulated replica: its step times against the planner's roofline, its runs of decode steps, and
its true prefix cache (hits, LRU eviction, admission only when the KV pool has room)."""

from __future__ import annotations

import pytest

from tokenmill.plan.catalogue import MODELS
from tokenmill.plan.gpus import GPUS, ceilings_for
from tokenmill.plan.memory import Deployment
from tokenmill.plan.roofline import decode_point, prefill_point
from tokenmill.router.fleet import Replica, Request, StepModel
from tokenmill.router.trace import Conversation, FreshTokens, Session

DEPLOYMENT = Deployment(MODELS["llama-3.1-8b"], GPUS["H200"])
CEILINGS = ceilings_for(GPUS["H200"], "bf16", measured=False)
OVERHEAD_S = 0.001


def _replica(
    capacity_blocks: int = 1000, max_num_seqs: int = 8, max_num_batched_tokens: int = 512
) -> Replica:
    step_model = StepModel(DEPLOYMENT, CEILINGS, tp=1, overhead_s=OVERHEAD_S)
    return Replica("r", capacity_blocks, 16, max_num_seqs, max_num_batched_tokens, step_model)


def _request(request_id: int, prompt: list[int] | range, output_len: int) -> Request:
    conversation = Conversation(16)
    conversation.extend(prompt)
    trace = conversation.request(FreshTokens().take(output_len), output_len)
    return Request(request_id, Session(0.0, [trace], []), 0, 0.0)


def _run_to_end(replica: Replica, now: float = 0.0) -> float:
    while (step := replica.plan_step(now)) is not None:
        now += step.duration_s
        replica.finish_step(now)
    return now


@pytest.mark.parametrize(("batch", "context_len"), [(1, 1), (37, 1000), (200, 3001)])
def test_a_decode_step_costs_the_planners_decode_point(batch, context_len):
    step_model = StepModel(DEPLOYMENT, CEILINGS, tp=1, overhead_s=0.0)
    point = decode_point(DEPLOYMENT, CEILINGS, 1, batch, context_len)
    floor_s = step_model.floor_s(batch, batch, batch * context_len, batch * context_len, 0)
    assert floor_s == pytest.approx(point.floor_s, rel=1e-12)


@pytest.mark.parametrize("input_len", [1, 700, 8191])
def test_a_whole_prompt_in_one_step_costs_the_planners_prefill_point(input_len):
    step_model = StepModel(DEPLOYMENT, CEILINGS, tp=1, overhead_s=0.0)
    point = prefill_point(DEPLOYMENT, CEILINGS, 1, input_len)
    pairs = input_len * (input_len + 1) // 2
    assert step_model.floor_s(input_len, 1, input_len, 0, pairs) == pytest.approx(point.floor_s, rel=1e-12)


def test_a_prompt_is_chunked_under_the_budget_then_decodes_as_one_run():
    replica = _replica(max_num_batched_tokens=512)
    request = _request(0, range(1000), output_len=5)
    replica.waiting.append(request)
    first = replica.plan_step(0.0)
    assert first is not None and [chunk for _, chunk in first.chunks] == [512]
    assert replica.finish_step(first.duration_s) == []
    second = replica.plan_step(first.duration_s)
    assert second is not None and [chunk for _, chunk in second.chunks] == [488]
    replica.finish_step(first.duration_s + second.duration_s)
    assert request.first_token_s == first.duration_s + second.duration_s
    run = replica.plan_step(request.first_token_s)
    assert run is not None and (run.num_steps, run.num_decodes, run.chunks) == (4, 1, [])
    one_step = decode_point(DEPLOYMENT, CEILINGS, 1, 1, 1001).floor_s + OVERHEAD_S
    assert run.duration_s > 4 * one_step  # the context grows a token a step
    assert replica.finish_step(run.start_s + run.duration_s) == [request]
    assert replica.num_output_tokens == 5
    assert replica.num_prefill_tokens == 1000


def test_an_arrival_cuts_a_run_of_decode_steps_at_the_next_step_boundary():
    replica = _replica()
    replica.waiting.append(_request(0, range(100), output_len=50))
    prefill = replica.plan_step(0.0)
    assert prefill is not None
    replica.finish_step(prefill.duration_s)
    run = replica.plan_step(prefill.duration_s)
    assert run is not None and run.num_steps == 49
    version = replica.version
    step_s = [*replica._decode_steps_s(3)]
    cut = replica.cut_short(run.start_s + step_s[0] + step_s[1] / 2)
    assert cut is not None and cut.num_steps == 2
    assert cut.duration_s == pytest.approx(step_s[0] + step_s[1])
    assert replica.version == version + 1
    assert replica.busy_s == pytest.approx(prefill.duration_s + cut.duration_s)
    replica.finish_step(run.start_s + cut.duration_s)
    assert replica.num_output_tokens == 3  # the prefill's token and two decode steps


def test_a_finished_prompt_stays_cached_and_a_repeat_hits_all_but_its_last_token():
    replica = _replica()
    replica.waiting.append(_request(0, range(160), output_len=3))
    _run_to_end(replica)
    repeat = _request(1, range(160), output_len=3)
    replica.waiting.append(repeat)
    _run_to_end(replica)
    assert repeat.num_cached_tokens == 159  # the last token is computed again for its logits
    other = _request(2, range(1000, 1160), output_len=3)
    replica.waiting.append(other)
    _run_to_end(replica)
    assert other.num_cached_tokens == 0


def test_the_least_recently_used_blocks_are_evicted_and_the_pool_is_never_exceeded():
    replica = _replica(capacity_blocks=25)
    first, second = _request(0, range(160), output_len=3), _request(1, range(1000, 1160), output_len=3)
    for request in (first, second):  # 10 prompt blocks and one partial block each
        replica.waiting.append(request)
        _run_to_end(replica)
    assert replica.num_blocks_held == 20
    third = _request(2, range(2000, 2160), output_len=3)
    replica.waiting.append(third)
    replica.plan_step(0.0)
    # 20 held + 10 new blocks + a partial one: 6 go, the oldest first. A finished request's blocks
    # were freed tail first, so the first prompt lost its last 6 blocks and kept its first 4.
    assert replica.num_blocks_held == 25
    _run_to_end(replica)
    again = _request(3, range(160), output_len=3)
    replica.waiting.append(again)
    _run_to_end(replica)
    assert again.num_cached_tokens == 4 * 16


def test_a_request_waits_while_running_requests_hold_the_pool():
    replica = _replica(capacity_blocks=15)
    running, waiting = _request(0, range(160), output_len=20), _request(1, range(1000, 1160), output_len=3)
    replica.waiting.extend([running, waiting])
    step = replica.plan_step(0.0)
    assert step is not None and [request for request, _ in step.chunks] == [running]
    assert list(replica.waiting) == [waiting] and replica.load == 2
    _run_to_end(replica)
    assert waiting.first_token_s > running.finish_s - 1e-12
    assert replica.num_blocks_held <= 15
