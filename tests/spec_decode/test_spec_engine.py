"""N-gram speculative decoding end to end on the CPU: greedy output is token for token what the engine
gives without speculation, on every architecture, with chunked prefill, preemption, prefix hits, aborts,
stop tokens among accepted drafts and max_tokens ending inside them; drafts are really accepted."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ARCHS
from tests.models.test_llama_equivalence import make_llm, random_prompts
from tests.serving.test_async_scheduling import run
from tokenmill import LLM, SamplingParams
from tokenmill.spec_decode import ReplayProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def copying_prompts() -> list[list[int]]:
    """Random prompts, and prompts that repeat a run of tokens (where random weights also tend to loop):
    the proposer finds matches in both."""
    loop = random_prompts([7], seed=9)[0]
    return random_prompts([5, 30, 17, 2], seed=2) + [loop * 4, (loop + [11]) * 3 + loop[:3]]


def greedy_only(results: dict, params: list[SamplingParams]) -> dict:
    return {k: v for k, v in results.items() if params[int(k)].temperature == 0}


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_unchanged_on_every_architecture(arch, hf_model_dirs) -> None:
    """Greedy requests (with a frequency penalty and min_tokens too: they see the drafts before each
    position as output) give the plain engine's tokens; a seeded sampled request gives the same tokens
    in two speculative runs (its generator draws in another order than without drafts)."""
    prompts = copying_prompts()
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.9, seed=5, n=2, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=37, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=23, temperature=0, min_tokens=3),
    ]
    # Small blocks, budget and cache: chunked prefill and preemption; one abort mid-run.
    engine_args = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=20, max_model_len=128)
    expected = run(make_llm(hf_model_dirs[arch][0], **engine_args), prompts, params, abort_at_step=4)
    spec = make_llm(hf_model_dirs[arch][0], **engine_args, speculative_config=NGRAM)
    got = run(spec, prompts, params, abort_at_step=4)
    assert greedy_only(got, params) == greedy_only(expected, params)
    assert spec.engine.scheduler.num_preemptions > 0
    # Random weights seldom copy their context, so n-gram drafts are mostly rejected: replaying the
    # plain run's tokens, a third of them corrupted, gives accepted runs, rejections at every position
    # and drafts that reach max_tokens.
    recorded = [(prompts[int(k)], r[0][0]) for k, r in expected.items() if k != "0"]
    replay = make_llm(hf_model_dirs[arch][0], **engine_args, speculative_config=NGRAM)
    replay.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=0.3)
    replayed = run(replay, prompts, params, abort_at_step=4)
    assert greedy_only(replayed, params) == greedy_only(expected, params)
    again = make_llm(hf_model_dirs[arch][0], **engine_args, speculative_config=NGRAM)
    again.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=0.3)
    assert run(again, prompts, params, abort_at_step=4) == replayed  # seeded: reproducible
    scheduler = replay.engine.scheduler
    assert 0 < scheduler.spec.num_accepted_tokens < scheduler.spec.num_draft_tokens
    assert all(count > 0 for count in scheduler.spec.accepted_per_position)

    # Stop on a token each greedy request produces (its 6th), which the drafts may carry past.
    stops = {i: r[0][0][5] for i, r in ((int(k), v) for k, v in expected.items())
             if len(r[0][0]) > 6 and params[i].min_tokens == 0 and params[i].temperature == 0}  # fmt: skip
    stopped = [
        p if i not in stops else SamplingParams(**{**p.__dict__, "stop_token_ids": [stops[i]]})
        for i, p in enumerate(params)
    ]
    plain = run(make_llm(hf_model_dirs[arch][0], **engine_args), prompts, stopped)
    assert greedy_only(run(replay, prompts, stopped), params) == greedy_only(plain, params)
    for i in stops:
        tokens, reason, _ = plain[str(i)][0]
        assert reason == "stop" and tokens[-1] == stops[i]


def test_prefix_hits_and_max_tokens_inside_the_drafts(hf_model_dirs) -> None:
    """The same prompt again reads its prefix from the cache; max_tokens that ends inside a step's
    accepted drafts cuts there (the scheduler never verifies drafts past it)."""
    loop = random_prompts([6], seed=4)[0]
    prompt = loop * 5
    engine_args = dict(block_size=4, max_model_len=128)
    plain = make_llm(hf_model_dirs["llama"][0], **engine_args)
    spec = make_llm(hf_model_dirs["llama"][0], **engine_args, speculative_config=NGRAM)
    for max_tokens in (3, 9, 40):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        want = plain.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        # Drafts that are all right (the plain run replayed), so max_tokens ends inside accepted ones.
        recorded = (prompt, want[0].outputs[0].token_ids + [0] * 8)
        spec.engine.runner.drafter.proposer = ReplayProposer([recorded], 4)
        for _ in range(2):  # the second time from the prefix cache
            got = spec.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
            assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
            assert len(got[0].outputs[0].token_ids) == max_tokens
    assert spec.engine.scheduler.kv.prefix_cache_hits > 0
    assert spec.engine.scheduler.spec.num_accepted_tokens > 0


def test_smollm2_copying_and_chat_with_stop_strings() -> None:
    """The embedded model: a prompt that asks for a copy of a passage (most drafts accepted) and free
    chat, with stop strings; the same texts as without speculation."""
    passage = "The quick brown fox jumps over the lazy dog, and the dog sleeps in the sun all day long."
    prompts = [f"Repeat this sentence exactly: {passage}\nRepeated: {passage[:20]}", "Once upon a time"]
    params = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=40, stop=[" was"]),
    ]
    results = []
    for speculative_config in (None, NGRAM):
        llm = LLM(dtype="float32", max_model_len=512, speculative_config=speculative_config)
        results.append(run(llm, prompts, params))
    assert results[0] == results[1]
    scheduler = llm.engine.scheduler
    assert scheduler.spec.num_accepted_tokens > 0


def test_sampled_requests_speculate_and_stay_valid(hf_model_dirs) -> None:
    """Unseeded sampled requests take drafts (accepted by rejection sampling); their outputs have the
    asked length and only vocabulary tokens."""
    loop = random_prompts([5], seed=3)[0]
    spec = make_llm(hf_model_dirs["qwen3"][0], block_size=4, max_model_len=128, speculative_config=NGRAM)
    params = SamplingParams(max_tokens=30, temperature=0.3, ignore_eos=True, n=4)
    outputs = spec.generate(prompt_token_ids=[loop * 6], sampling_params=params, use_tqdm=False)
    for sample in outputs[0].outputs:
        assert len(sample.token_ids) == 30 and all(0 <= t < 1003 for t in sample.token_ids)
    assert spec.engine.scheduler.spec.num_drafts > 0


def test_dynamic_speculation_by_batch_size_and_by_acceptance(hf_model_dirs) -> None:
    """A step with disable_by_batch_size running requests verifies no drafts; a request whose drafts
    keep being rejected stops taking them except for a probe every few steps; output unchanged."""
    prompts = copying_prompts()[:4]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine_args = dict(block_size=4, max_model_len=128)
    plain = make_llm(hf_model_dirs["llama"][0], **engine_args)
    want = [
        o.outputs[0].token_ids
        for o in plain.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]
    recorded = list(zip(prompts, want))

    def spec_run(corrupt: float = 0.0, **spec_keys) -> tuple[LLM, list[list[int]]]:
        llm = make_llm(hf_model_dirs["llama"][0], **engine_args, speculative_config={**NGRAM, **spec_keys})
        llm.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=corrupt)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outputs]

    # Four requests at once, speculation off from 4 running: only steps with fewer running speculate.
    llm, got = spec_run(disable_by_batch_size=4)
    assert got == want and llm.engine.scheduler.spec.num_drafts == 0
    llm, got = spec_run(disable_by_batch_size=5)
    assert got == want and llm.engine.scheduler.spec.num_drafts > 0

    # Every draft wrong: after the running average drops below min_acceptance, a probe every 8 steps.
    llm, got = spec_run(corrupt=1.0, min_acceptance=0.2)
    scheduler = llm.engine.scheduler
    assert got == want and scheduler.spec.num_accepted_tokens == 0
    steps_per_request = 40  # at one token per step, nothing being accepted
    assert 0 < scheduler.spec.num_drafts < len(prompts) * (6 + steps_per_request // 8)
    llm, got = spec_run(corrupt=1.0)  # the default never gives up
    # Every decode step verifies drafts but the last (max_tokens leaves no room for one).
    assert got == want and llm.engine.scheduler.spec.num_drafts == len(prompts) * (steps_per_request - 2)


class ConstantProposer:
    """Proposes the same drafts for every request: a sampled request then meets drafts that are right
    sometimes, wrong other times, and outside its top-k now and then."""

    def __init__(self, drafts: list[int]) -> None:
        self.drafts = drafts

    def propose(self, token_ids, max_tokens=None, request_id=None) -> list[int]:
        return self.drafts[: len(self.drafts) if max_tokens is None else max_tokens]

    def forget(self, request_id) -> None:
        pass


def test_sampled_tokens_keep_their_distribution_through_the_engine(hf_model_dirs) -> None:
    """2,000 sampled requests (temperature 1, top-k 5) with and without drafts: the second and third
    tokens, which speculation produces by rejection sampling, have the same distribution (two-sample
    chi-square), and the drafts were both accepted and rejected."""
    import torch

    from tests.spec_decode.test_verify import two_sample_chi_square_p

    prompt = random_prompts([6], seed=11)[0]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True)
    engine_args = dict(block_size=4, max_model_len=64, max_num_seqs=256)
    counts = []
    for speculative in (False, True):
        llm = make_llm(
            hf_model_dirs["qwen2"][0], **engine_args, speculative_config=NGRAM if speculative else None
        )
        if speculative:
            # Two of the likeliest second tokens as drafts (from the plain run's samples).
            top = counts[0][0].argsort(descending=True)
            llm.engine.runner.drafter.proposer = ConstantProposer([int(top[0]), int(top[1])])
        outputs = llm.generate(prompt_token_ids=[prompt] * 2000, sampling_params=params, use_tqdm=False)
        tokens = torch.tensor([o.outputs[0].token_ids for o in outputs])
        counts.append([torch.bincount(tokens[:, i], minlength=1003).double() for i in (1, 2)])
    scheduler = llm.engine.scheduler
    assert 0 < scheduler.spec.num_accepted_tokens < scheduler.spec.num_draft_tokens
    for plain, spec in zip(*counts):
        assert two_sample_chi_square_p(plain, spec) > 1e-3


def test_logprobs_come_for_every_token_of_a_verifying_step(hf_model_dirs) -> None:
    """A request asking for logprobs speculates too: one entry per token, each token's logprob and top
    alternatives as the plain engine reports them (fp32, to rounding)."""
    loop = random_prompts([6], seed=4)[0]
    prompt = loop * 4
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    plain = make_llm(hf_model_dirs["qwen3"][0], max_model_len=128)
    want = plain.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    spec = make_llm(hf_model_dirs["qwen3"][0], max_model_len=128, speculative_config=NGRAM)
    spec.engine.runner.drafter.proposer = ReplayProposer(
        [(prompt, want.token_ids)], 4, corrupt_rate=0.25, seed=3
    )
    got = spec.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 12
    for a, b in zip(got.logprobs, want.logprobs):
        assert list(a) == list(b)  # the same top tokens, in order
        for token_id in a:
            assert abs(a[token_id].logprob - b[token_id].logprob) < 1e-4
    scheduler = spec.engine.scheduler
    assert 0 < scheduler.spec.num_accepted_tokens < scheduler.spec.num_draft_tokens


LAYER_SKIP = {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 1}


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_skip_keeps_greedy_output_on_every_architecture(arch, hf_model_dirs) -> None:
    """Self-speculation (the first layer of two drafts, writing its KV past the computed tokens into the
    slots allocated ahead): the plain engine's greedy tokens, with chunked prefill, preemption, an
    abort and every block freed at the end; its drafts are accepted now and then."""
    prompts = copying_prompts()
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=37, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=23, temperature=0, min_tokens=3),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    engine_args = dict(block_size=4, num_kv_blocks=34, max_num_batched_tokens=20, max_model_len=128)
    expected = run(make_llm(hf_model_dirs[arch][0], **engine_args), prompts, params, abort_at_step=4)
    spec = make_llm(hf_model_dirs[arch][0], **engine_args, speculative_config=LAYER_SKIP)
    assert run(spec, prompts, params, abort_at_step=4) == expected
    scheduler = spec.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.spec.num_drafts > 0


def test_layer_skip_needs_fewer_draft_layers_than_the_model(hf_model_dirs) -> None:
    with pytest.raises(ValueError, match="draft_layers"):
        make_llm(hf_model_dirs["llama"][0], speculative_config={**LAYER_SKIP, "draft_layers": 2})
    with pytest.raises(ValueError, match="needs draft_layers"):
        make_llm(
            hf_model_dirs["llama"][0],
            speculative_config={"method": "layer_skip", "num_speculative_tokens": 2},
        )


@pytest.mark.parametrize("draft_arch", ["qwen2", "llama"])
def test_draft_model_keeps_greedy_output(draft_arch, hf_model_dirs) -> None:
    """A separate draft model with its own KV cache in the same blocks: a different small model (drafts
    mostly rejected) or the target itself (drafts all but always accepted), with chunked prefill,
    preemption and an abort: the plain engine's greedy tokens, and every block freed."""
    prompts = copying_prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 1, 25, 37, 23, 30)]
    engine_args = dict(block_size=4, num_kv_blocks=34, max_num_batched_tokens=20, max_model_len=128)
    target = hf_model_dirs["llama"][0]
    expected = run(make_llm(target, **engine_args), prompts, params, abort_at_step=4)
    config = {"method": "draft_model", "num_speculative_tokens": 3, "model": hf_model_dirs[draft_arch][0]}
    spec = make_llm(target, **engine_args, speculative_config=config)
    assert run(spec, prompts, params, abort_at_step=4) == expected
    scheduler = spec.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.spec.num_drafts > 0
    if draft_arch == "llama":  # the target drafting for itself
        assert scheduler.spec.num_accepted_tokens > 0.9 * scheduler.spec.num_draft_tokens


def test_draft_model_must_share_the_vocabulary(hf_model_dirs, tmp_path) -> None:
    from tests.conftest import make_hf_model

    model = make_hf_model("qwen2")
    model.resize_token_embeddings(1100)
    model.save_pretrained(tmp_path)
    config = {"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path)}
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        make_llm(hf_model_dirs["llama"][0], speculative_config=config)
    with pytest.raises(ValueError, match="needs model"):
        make_llm(
            hf_model_dirs["llama"][0],
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2},
        )


@pytest.mark.parametrize("method", ["layer_skip", "draft_model"])
def test_model_drafts_after_a_prefix_hit(method, hf_model_dirs) -> None:
    """A second request over the same prompt reads its prefix from the cache, where the drafting layers
    (or the draft model, in the same blocks) find the KV the first request left: same greedy tokens, and
    the target drafting for itself keeps its drafts right after the hit (the draft's cached KV is
    its own, not garbage)."""
    loop = random_prompts([6], seed=5)[0]
    prompt = loop * 5 + [7, 8]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine_args = dict(block_size=4, max_model_len=128)
    target = hf_model_dirs["qwen3"][0]
    want = make_llm(target, **engine_args).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False
    )
    config = {"method": method, "num_speculative_tokens": 3}
    config.update({"draft_layers": 1} if method == "layer_skip" else {"model": target})
    spec = make_llm(target, **engine_args, speculative_config=config)
    scheduler = spec.engine.scheduler
    for _ in range(2):
        before = (scheduler.spec.num_draft_tokens, scheduler.spec.num_accepted_tokens)
        got = spec.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert scheduler.kv.prefix_cache_hits > 0 and scheduler.spec.num_drafts > 0
    if method == "draft_model":
        drafted = scheduler.spec.num_draft_tokens - before[0]
        assert scheduler.spec.num_accepted_tokens - before[1] > 0.9 * drafted


@pytest.mark.parametrize("method", ["ngram", "layer_skip", "draft_model"])
def test_async_scheduling_overlaps_the_steps_that_do_not_speculate(method, hf_model_dirs) -> None:
    """With async scheduling, steps at a batch of disable_by_batch_size or more overlap the next (two in
    flight, no drafts proposed) and smaller ones speculate synchronously; the batch crosses the limit
    both ways as requests arrive, finish and are preempted. Greedy tokens are the plain engine's."""
    prompts = copying_prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 3, 25, 37, 23, 30)]
    engine_args = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=20, max_model_len=128)
    target = hf_model_dirs["llama"][0]
    expected = run(make_llm(target, **engine_args), prompts, params, abort_at_step=4)
    config = {"ngram": NGRAM, "layer_skip": LAYER_SKIP, "draft_model": {
        "method": "draft_model", "num_speculative_tokens": 3, "model": target}}[method]  # fmt: skip
    spec = make_llm(target, **engine_args, async_scheduling=True,
                    speculative_config={**config, "disable_by_batch_size": 4})  # fmt: skip
    if method == "ngram":
        recorded = [(prompts[int(k)], r[0][0]) for k, r in expected.items()]
        spec.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=0.3)
    core = spec.engine.core
    depths = []
    launch = core.executor.launch

    def launch_noting_depth(prepared):
        depths.append(len(core.batch_queue))
        return launch(prepared)

    core.executor.launch = launch_noting_depth
    assert run(spec, prompts, params, abort_at_step=4) == expected
    scheduler = spec.engine.scheduler
    assert scheduler.spec.num_accepted_tokens > 0 and scheduler.num_preemptions > 0
    assert 1 in depths  # a step launched while another was in flight


def test_the_next_verifying_step_is_launched_before_step_returns(hf_model_dirs) -> None:
    """While a speculating loop runs, step() hands back step N's outputs with step N+1 (which verifies
    the drafts proposed from N's tokens) already launched, so the caller's work on the outputs overlaps
    the device; tokens are the plain engine's, with a stop token, an abort mid-run and preemption, and
    every block comes back."""
    prompts = copying_prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 3, 25, 37, 23, 30)]
    engine_args = dict(block_size=4, num_kv_blocks=32, max_num_batched_tokens=20, max_model_len=128)
    target = hf_model_dirs["llama"][0]
    expected = run(make_llm(target, **engine_args), prompts, params, abort_at_step=4)
    sixth = expected["3"][0][0][5]  # request 3 stops at the text of a token it is known to produce
    params[3] = SamplingParams(max_tokens=37, temperature=0, ignore_eos=True, stop_token_ids=[sixth])
    expected = run(make_llm(target, **engine_args), prompts, params, abort_at_step=4)
    spec = make_llm(target, **engine_args, speculative_config=NGRAM)
    recorded = [(prompts[int(k)], r[0][0]) for k, r in expected.items()]
    spec.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=0.3)
    core = spec.engine.core
    in_flight_on_return = []
    step = core.step

    def step_noting_queue():
        outputs = step()
        in_flight_on_return.append(len(core.batch_queue))
        return outputs

    core.step = step_noting_queue
    assert run(spec, prompts, params, abort_at_step=4) == expected
    assert spec.engine.scheduler.spec.num_accepted_tokens > 0 and spec.engine.scheduler.num_preemptions > 0
    # Every return but the last (nothing left to launch) leaves the next step on the device.
    assert in_flight_on_return[-1] == 0 and all(depth == 1 for depth in in_flight_on_return[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_method_on_the_gpu(hf_model_dirs) -> None:
    """On CUDA (Triton kernels, decode CUDA graphs for plain steps, verify graphs for the verify steps),
    fp32: each method gives the plain engine's greedy tokens and accepts drafts."""
    prompts = copying_prompts()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    target = hf_model_dirs["llama"][0]
    # A dropped engine's memory comes back only at the next full garbage collection, and other tests'
    # engines in this process hold theirs: a fixed number of KV blocks each, not a share of what is free.
    engine_args = dict(block_size=16, max_model_len=256, num_kv_blocks=160)
    want = [o.outputs[0].token_ids for o in make_llm(target, **engine_args).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)]  # fmt: skip
    recorded = list(zip(prompts, want))
    for config in (
        NGRAM,
        {"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 1},
        {"method": "draft_model", "num_speculative_tokens": 3, "model": target},
    ):
        # A fixed batch limit: on a model this small the cost model finds drafting too dear to speculate.
        spec = make_llm(target, **engine_args, speculative_config={**config, "disable_by_batch_size": 64})
        if config is NGRAM:
            spec.engine.runner.drafter.proposer = ReplayProposer(recorded, 4, corrupt_rate=0.3)
        graphs = spec.engine.runner.verify_graphs
        replays = []
        graphs.run = lambda *args, replay=graphs.run, replays=replays: replays.append(1) or replay(*args)
        outputs = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == want, config["method"]
        assert spec.engine.scheduler.spec.num_accepted_tokens > 0, config["method"]
        assert replays, config["method"]  # the verify steps ran as whole-step graphs
        del spec
        torch.cuda.empty_cache()


@pytest.mark.parametrize("method", ["layer_skip", "draft_model"])
def test_drafting_up_to_the_context_length(method, hf_model_dirs) -> None:
    """A request a few positions short of max_model_len drafts fewer tokens than the one beside it; the
    drafter's one-token steps run for the longest budget, and the short request's steps past its own
    (which would be past the context: the rotary table's end) compute at a harmless position. Greedy
    tokens are the plain engine's, up to the context length."""
    path = hf_model_dirs["llama"][0]
    config = {"method": method, "num_speculative_tokens": 4}
    config.update({"draft_layers": 1} if method == "layer_skip" else {"model": path})
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    prompts = [random_prompts([58], seed=6)[0], [5, 6, 7]]
    plain = make_llm(path, max_model_len=64).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False
    )
    spec = make_llm(path, max_model_len=64, speculative_config=config)
    got = spec.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert [len(o.outputs[0].token_ids) for o in got] == [64 - 58, 64 - 3]


def test_the_drafts_max_model_len_stops_speculation_there(hf_model_dirs) -> None:
    """vLLM's speculative max_model_len: no draft is verified at a position from it on, so a request
    past it decodes a token a step; greedy tokens are the plain engine's. Larger than the target's
    max_model_len is refused by name."""
    path = hf_model_dirs["llama"][0]
    prompt = random_prompts([10], seed=5)[0]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = (
        make_llm(path, max_model_len=128)
        .generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    spec = make_llm(path, max_model_len=128, speculative_config={**NGRAM, "max_model_len": 24})
    spec.engine.runner.drafter.proposer = ReplayProposer([(prompt, want)], 4)  # every draft right
    verified = []  # (tokens the request held, drafts verified after them)
    drafts = spec.engine.scheduler.spec.drafts
    spec.engine.scheduler.spec.drafts = lambda request, *args: verified.append(
        (request.num_tokens, len(out := drafts(request, *args)))
    ) or out  # fmt: skip
    got = spec.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want
    assert any(n for _, n in verified) and all(tokens + n < 24 for tokens, n in verified if n)
    assert verified[-1] == (10 + 29, 0)  # the last step, past 24, verified none
    with pytest.raises(ValueError, match=r"max_model_len \(200\) is larger than the target's"):
        make_llm(path, max_model_len=128, speculative_config={**NGRAM, "max_model_len": 200})
