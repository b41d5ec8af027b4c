"""Verification of drafts: greedy keeps the target's argmax path; rejection sampling with a one-hot draft
leaves the target's distribution exactly as it was (checked by a chi-square test over many rows)."""

from __future__ import annotations

import torch

from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.input_batch import CachedRequestState
from tokenmill.worker.sampler import Sampler, resolve_drafts
from tokenmill.worker.sampling_batch import SamplingBatch


def batch_of(rows: int, temperature: float, top_k: int, top_p: float, vocab: int) -> SamplingBatch:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    state = CachedRequestState("r", [1], params, frozenset(), [], 0)
    greedy = temperature == 0
    return SamplingBatch(
        requests=[state] * rows,
        temperature=None if greedy else torch.full((rows,), temperature),
        top_k=None if greedy else torch.full((rows,), top_k if top_k > 0 else vocab),
        top_p=None if greedy else torch.full((rows,), top_p),
        min_p=None if greedy else torch.zeros(rows),
        all_greedy=greedy,
        needs_logit_edits=False,
        needs_top_k_p=not greedy and (0 < top_k < vocab or top_p < 1),
        needs_min_p=False,
        needs_penalties=False,
        generators={},
        max_num_logprobs=-1,
    )


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against expected probabilities (cells of expected count >= 5)."""
    expected = probs * counts.sum()
    keep = expected >= 5
    stat = (((counts - expected) ** 2) / expected)[keep].sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2))


def test_greedy_accepts_exactly_the_argmax_path() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=gen)
    argmax = logits.argmax(-1)
    drafts = torch.tensor([int(argmax[0]), int(argmax[1]), (int(argmax[2]) + 1) % 11, -1, -1])
    verified, _ = Sampler().verify(logits, batch_of(5, 0.0, 0, 1.0, 11), drafts)
    assert verified.accepted.tolist() == [True, True, False, False, False]
    host = [t.tolist() for t in verified]
    # Request 0: three drafts over rows 0-2 and its own row 3; request 1: no draft, row 4.
    tokens = resolve_drafts(host, [drafts[:3].tolist(), []], [0, 4])
    assert tokens == [[int(argmax[0]), int(argmax[1]), int(argmax[2])], [int(argmax[4])]]
    all_accepted = resolve_drafts([[True] * 5, host[1]], [drafts[:3].tolist(), []], [0, 4])
    assert all_accepted[0] == drafts[:3].tolist() + [int(argmax[3])]


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Every row has the same logits and the same draft: the token that stands at the row (the draft if
    accepted, else the replacement) must be distributed as the target's own sampling distribution,
    for a likely draft, an unlikely one, and under top-k/top-p (a draft outside the kept set)."""
    torch.manual_seed(0)
    vocab, rows = 12, 60_000
    logits_row = torch.randn(vocab) * 1.5
    sampler = Sampler()
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 6, 0.9)):
        batch = batch_of(rows, temperature, top_k, top_p, vocab)
        _, probs = sampler._process(logits_row.expand(rows, vocab).clone(), batch)
        target = probs[0]
        order = target.argsort(descending=True)
        for draft in (int(order[0]), int(order[3]), int(order[-1])):
            logits = logits_row.expand(rows, vocab).clone()
            verified, _ = sampler.verify(logits, batch, torch.full((rows,), draft))
            tokens = torch.where(verified.accepted, torch.tensor(draft), verified.token)
            counts = torch.bincount(tokens, minlength=vocab).double()
            assert chi_square_p(counts, target.double()) > 1e-3, (temperature, draft)
            assert abs(verified.accepted.double().mean() - target[draft]) < 0.01


def two_sample_chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value that two histograms of equal totals come from one distribution (cells seen >= 10 times)."""
    keep = (a + b) >= 10
    a, b = a[keep], b[keep]
    stat = (((a - b) ** 2) / (a + b)).sum()
    return float(torch.special.gammaincc(torch.tensor((int(keep.sum()) - 1) / 2.0), stat / 2))
