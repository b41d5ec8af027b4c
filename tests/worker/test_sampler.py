"""Sampling: each knob's effect on a known distribution, and seeds independent of the batch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker import sampler as sampler_module
from tokenmill.worker.input_batch import CachedRequestState, InputBatch
from tokenmill.worker.sampler import Sampler, one_launch
from tokenmill.worker.sampling_batch import build_sampling_batch

VOCAB = 11


class _Runner:
    """Just enough of a ModelRunner (its input batch and seeded generators) to build sampling batches."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.generators: dict = {}
        self.input_batch = InputBatch(max_num_reqs=8, max_blocks_per_seq=1, block_size=16)
        self._last_row_of: dict = {}

    def _sampling_batch(self, inputs, vocab_size: int):
        requests = [self.input_batch.requests[r] for r in inputs.req_ids]
        return build_sampling_batch(requests, inputs.samples, self.generators, self.device, vocab_size)


def batch_of(params: list[SamplingParams], outputs=None, prompts=None, runner=None):
    """The SamplingBatch of one request per params (prompts and outputs: row -> token ids)."""
    runner = runner or _Runner()
    req_ids = []
    for i, p in enumerate(params):
        state = CachedRequestState(
            f"r{i}",
            list((prompts or {}).get(i, [0])),
            p,
            frozenset({1}),
            block_ids=[],
            num_computed_tokens=0,
            output_token_ids=list((outputs or {}).get(i, [])),
        )
        state.num_pending_tokens = 1  # the step's own token, as input_batch.prepare leaves a sampling row
        runner.input_batch.requests[state.req_id] = state
        req_ids.append(state.req_id)
    inputs = SimpleNamespace(req_ids=req_ids, samples=[True] * len(req_ids), pending_src_req_ids=[])
    return runner._sampling_batch(inputs, VOCAB)


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs=None, prompts=None, runner=None):
    return Sampler()(logits.clone(), batch_of(params, outputs, prompts, runner))


def peaked(top: int, rows: int = 1) -> torch.Tensor:
    logits = torch.zeros(rows, VOCAB)
    logits[:, top] = 5.0
    return logits


def test_greedy_takes_argmax():
    tokens, logprobs = sample(peaked(4, rows=2), [SamplingParams(temperature=0)] * 2)
    assert tokens.tolist() == [4, 4] and logprobs is None


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
    tokens, _ = sample(logits, [SamplingParams(temperature=5.0, top_k=1)] * 8)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_p_and_min_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05] + [1e-9] * (VOCAB - 5)])).repeat(400, 1)
    top_p, _ = sample(logits, [SamplingParams(temperature=1.0, top_p=0.75)] * 400)
    assert set(top_p.tolist()) == {0, 1}
    min_p, _ = sample(logits, [SamplingParams(temperature=1.0, min_p=0.25)] * 400)
    assert set(min_p.tolist()) == {0, 1}


def test_temperature_sampling_follows_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3))
    logits = torch.log(probs.clamp_min(1e-12)).repeat(4000, 1)
    torch.manual_seed(0)
    tokens, _ = sample(logits, [SamplingParams(temperature=1.0)] * 4000)
    freq = torch.bincount(tokens, minlength=VOCAB).float() / 4000
    assert torch.allclose(freq[:3], probs[:3], atol=0.03)


def test_sampling_never_draws_a_token_without_mass_and_matches_the_masses():
    """Masses scattered over a wide vocabulary with holes (a grammar's mask, top-k), rows that do not sum
    to 1 (min-p): each draw lands on a token with mass, in proportion to it."""
    from tokenmill.worker.sampler import _random_sample

    gen = torch.Generator().manual_seed(1)
    vocab, rows = 4099, 3000
    mass = torch.rand(vocab, generator=gen) * (torch.rand(vocab, generator=gen) < 0.01)
    mass[0] = mass[-1] = 0.0  # holes at both ends
    mass[[5, 1000, 4097]] = torch.tensor([3.0, 1.0, 0.5])
    probs = (mass * 0.37).repeat(rows, 1)
    torch.manual_seed(0)
    tokens = _random_sample(probs, {7: torch.Generator().manual_seed(9)})
    assert bool((mass[tokens] > 0).all())
    freq = torch.bincount(tokens, minlength=vocab).float() / rows
    expected = mass / mass.sum()
    assert torch.allclose(freq[[5, 1000, 4097]], expected[[5, 1000, 4097]], atol=0.03)
    # A row whose every token is masked but one draws that one.
    only = torch.zeros(2, vocab)
    only[:, 4098] = 1e-30
    assert _random_sample(only, {}).tolist() == [4098, 4098]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.0, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=3, min_p=0.1, logprobs=2),
        SamplingParams(temperature=1.0, seed=4, logprobs=2),
    ],
)
def test_a_row_with_every_token_masked_gives_token_0(params: SamplingParams):
    """allowed_token_ids that a grammar's mask or min_tokens' ban leaves empty: the row is all -inf. It
    gives token 0, as torch.argmax and kernels/sample.py do (and a token of the vocabulary, so the
    embedding and the logprobs do not index past it); the row beside it samples as it would."""
    logits = torch.full((2, VOCAB), float("-inf"))
    logits[1, 5] = 0.0
    tokens, logprobs = Sampler()(logits, batch_of([params, params]))
    assert tokens.tolist() == [0, 5]
    assert logprobs.tolist([2, 2])[1].logprob == 0.0


def test_seed_gives_same_tokens_whatever_the_batch():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits, [seeded])[0].item() for _ in range(1)]
    runner = _Runner()
    crowd_logits = torch.cat([torch.randn(5, VOCAB), logits])
    crowded = sample(crowd_logits, [SamplingParams(temperature=1.0)] * 5 + [seeded], runner=runner)[0][
        -1
    ].item()
    assert alone == [crowded]
    # A fresh runner replays the same stream; the same runner continues it.
    streams = [
        [sample(logits, [seeded], runner=r)[0].item() for _ in range(6)] for r in (_Runner(), _Runner())
    ]
    assert streams[0] == streams[1]


def test_penalties():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 5] = 2.0, 1.9
    # Token 3 was already generated twice: frequency 0.1 * 2 drops it below token 5.
    tokens, _ = sample(logits, [SamplingParams(temperature=0, frequency_penalty=0.1)], outputs={0: [3, 3]})
    assert tokens.item() == 5
    tokens, _ = sample(logits, [SamplingParams(temperature=0, presence_penalty=0.2)], outputs={0: [3]})
    assert tokens.item() == 5
    # Repetition penalty counts prompt tokens too: 2.0 / 1.1 < 1.9.
    tokens, _ = sample(logits, [SamplingParams(temperature=0, repetition_penalty=1.1)], prompts={0: [3]})
    assert tokens.item() == 5


def test_a_pending_token_that_lands_before_sampling_is_penalised_once():
    """A grammar step's batch is built while the step before it is in flight (its token pending on the
    device), and sampled after that token reached the host's list: it counts once, not twice."""
    runner = _Runner()
    runner._last_sampled, runner._last_row_of = torch.tensor([3]), {"r0": 0}
    state = CachedRequestState(
        "r0", [0], SamplingParams(temperature=0, frequency_penalty=0.04), frozenset({1}),
        block_ids=[], num_computed_tokens=0, output_token_ids=[3],
    )  # fmt: skip
    runner.input_batch.requests["r0"] = state
    inputs = SimpleNamespace(req_ids=["r0"], samples=[True], pending_src_req_ids=["r0"])
    batch = runner._sampling_batch(inputs, VOCAB)
    state.append_output_token(3)  # the pending token lands before the masked sampling
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 5] = 2.0, 1.9
    # Token 3 twice (the earlier one and the pending one): 2.0 - 0.08 > 1.9; three times would be 1.88.
    tokens, _ = Sampler()(logits, batch)
    assert tokens.item() == 3


def test_min_tokens_counts_the_outputs_as_they_were_when_the_batch_was_built():
    """The next step's host half runs before a grammar step samples, and counts its own pending token:
    the grammar step still sees the count of its own time (here one short of min_tokens: EOS stays
    banned)."""
    runner = _Runner()
    state = CachedRequestState(
        "r0", [0], SamplingParams(temperature=0, min_tokens=3), frozenset({1}),
        block_ids=[], num_computed_tokens=0, output_token_ids=[4, 4],
    )  # fmt: skip
    state.num_pending_tokens = 1  # this step's own token (input_batch.prepare counts it)
    runner.input_batch.requests["r0"] = state
    inputs = SimpleNamespace(req_ids=["r0"], samples=[True], pending_src_req_ids=[])
    batch = runner._sampling_batch(inputs, VOCAB)
    state.num_pending_tokens += 1  # the next step, prepared before this one samples
    tokens, _ = Sampler()(peaked(1), batch)
    assert tokens.item() != 1


@pytest.mark.parametrize("min_tokens", [1, 2, 3])
def test_min_tokens_lets_eos_come_only_after_that_many_tokens(min_tokens):
    """vLLM's rule: EOS and the stop tokens are banned while fewer than min_tokens tokens came out, so
    the earliest EOS is token min_tokens + 1."""
    params = SamplingParams(temperature=0, min_tokens=min_tokens)
    for before in range(min_tokens + 2):
        tokens, _ = sample(peaked(1), [params], outputs={0: [4] * before})
        assert (tokens.item() == 1) == (before >= min_tokens), before


def test_min_tokens_masks_eos_and_logit_bias_shifts():
    tokens, _ = sample(peaked(1), [SamplingParams(temperature=0, min_tokens=2)])
    assert tokens.item() != 1
    tokens, _ = sample(peaked(4), [SamplingParams(temperature=0, logit_bias={6: 10.0})])
    assert tokens.item() == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_penalties_bias_and_min_tokens_never_wait_for_the_device():
    """Their token ids reach the device through pinned memory: a copy from pageable memory waits for
    every kernel already queued (the step's forward pass), stalling the host async scheduling keeps
    ahead. CUDA's sync debug mode turns any such wait into an error."""
    runner = _Runner()
    runner.device = torch.device("cuda")
    logits = torch.zeros(3, VOCAB, device="cuda")
    logits[0, 3], logits[0, 5] = 2.0, 1.9
    logits[1, 4] = logits[2, 1] = 5.0
    params = [
        SamplingParams(temperature=0, frequency_penalty=0.1, repetition_penalty=1.1),
        SamplingParams(temperature=0, logit_bias={6: 10.0}),
        SamplingParams(temperature=0, min_tokens=2),
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, _ = sample(logits, params, outputs={0: [3, 3]}, prompts={0: [3]}, runner=runner)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens[:2].tolist() == [5, 6] and tokens[2].item() != 1


def test_logprobs_are_raw_log_softmax_with_top_k_and_rank():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    tokens, logprobs = sample(
        logits, [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    )
    expected = logits[0].log_softmax(-1)
    logprobs = logprobs.tolist([3, None])
    entry = logprobs[0]
    assert math.isclose(entry.logprob, expected[tokens[0]].item(), rel_tol=1e-6)
    assert entry.rank == 1
    assert entry.top_token_ids == expected.topk(3).indices.tolist()
    assert logprobs[1] is None


@pytest.mark.parametrize(
    ("params", "takes_it"),
    [
        (SamplingParams(temperature=0), True),
        (SamplingParams(temperature=0.8), True),
        (SamplingParams(temperature=0.8, top_p=0.9), False),
        (SamplingParams(temperature=0.8, top_k=5), False),
        (SamplingParams(temperature=0.8, min_p=0.1), False),
        (SamplingParams(temperature=0.8, seed=3), False),
        (SamplingParams(temperature=0.8, logprobs=2), False),
        (SamplingParams(temperature=0, presence_penalty=0.5), False),
        (SamplingParams(temperature=0, logit_bias={2: 1.0}), False),
        (SamplingParams(temperature=0, min_tokens=2), False),
    ],
)
def test_one_launch_takes_greedy_and_temperature_alone(params: SamplingParams, takes_it: bool) -> None:
    """A batch with any row that needs more than greedy or temperature keeps the torch form; and only a
    GPU's logits go to the kernel."""
    batch = batch_of([SamplingParams(temperature=0), params])
    assert one_launch(SimpleNamespace(is_cuda=True), batch) is takes_it
    assert not one_launch(torch.zeros(2, VOCAB), batch)


def test_the_one_launch_switch_names_its_values() -> None:
    assert sampler_module._one_launch_switch("0") is False
    with pytest.raises(ValueError, match="TOKENMILL_ONE_LAUNCH_SAMPLING='yes'"):
        sampler_module._one_launch_switch("yes")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_launch_sampling_on_a_gpu_matches_greedy_and_never_waits() -> None:
    """The kernel's greedy rows give the torch form's tokens; its draws stay in the vocabulary and off
    forbidden tokens; and it queues without waiting for the device."""
    runner = _Runner()
    runner.device = torch.device("cuda")
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(9)).cuda()
    logits[3:, :4] = float("-inf")
    params = [SamplingParams(temperature=0)] * 3 + [SamplingParams(temperature=1.3)] * 3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs = sample(logits, params, runner=runner)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logprobs is None
    assert tokens[:3].tolist() == logits[:3].argmax(dim=-1).tolist()
    assert all(4 <= t < VOCAB for t in tokens[3:].tolist())
