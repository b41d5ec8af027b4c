"""The worker runs from the scheduler's records alone: every SchedulerOutput of a long mixed run
(chunked prefill, prefix hits, preemption, aborts, async scheduling), encoded with msgspec and replayed
into a fresh worker, gives the same tokens."""

from __future__ import annotations

import msgspec
import pytest

from tests.conftest import ARCHS
from tests.models.test_llama_equivalence import make_llm, random_prompts
from tokenmill import SamplingParams
from tokenmill.core.sched_output import SchedulerOutput


class Recorder:
    """Wraps a runner's launch: keeps each step's encoded records and the tokens it sampled."""

    def __init__(self, runner) -> None:
        self.launch = runner.launch
        self.steps: list[tuple[bytes, object]] = []
        runner.launch = self

    def __call__(self, prepared):
        encoded = msgspec.msgpack.encode(prepared.scheduler_output)
        pending = self.launch(prepared)
        self.steps.append((encoded, pending))
        return pending


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("arch", ARCHS[:2])
def test_replayed_records_give_identical_tokens(arch, async_scheduling, hf_model_dirs):
    path = hf_model_dirs[arch][0]
    options = dict(
        block_size=4,
        num_kv_blocks=40,
        max_model_len=96,
        max_num_batched_tokens=24,
        async_scheduling=async_scheduling,
    )
    llm = make_llm(path, **options)
    recorder = Recorder(llm.engine.runner)
    shared = random_prompts([20], seed=9)[0]
    prompts = random_prompts([5, 30, 17, 44, 9, 2], seed=4) + random_prompts([3, 8], seed=5, prefix=shared)
    params = [
        SamplingParams(max_tokens=12 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(prompts))
    ]
    params[2] = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    params[3] = SamplingParams(max_tokens=20, temperature=0, presence_penalty=1.5, ignore_eos=True)
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 6:
            engine.abort_request("1")  # mid-run, possibly with a step of it in flight
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.kv.prefix_cache_hits > 0
    assert "1" not in finished and len(finished) == len(prompts) - 1

    fresh = make_llm(path, **options).engine.runner
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    assert len(recorder.steps) >= steps // 2  # the recorder saw the run's launches
    for encoded, pending in recorder.steps:
        replayed = fresh.execute(decoder.decode(encoded)).result()
        original = pending.result()
        assert replayed.req_ids == original.req_ids
        assert replayed.sampled_token_ids == original.sampled_token_ids
