"""The one-launch sampling kernel against its torch reference: greedy rows give exactly the reference's
token (first index of the largest logit, ties and -inf included, across the kernel's blocks), drawn rows
follow softmax(logits / T) (frequencies over many rows within a few standard errors, forbidden tokens
never drawn), and the same seed gives the same draws."""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.kernels import reference, sample
from tokenmill.kernels.sample import SAMPLE_BLOCK, sample_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCK = 64  # the statistical tests' rows span several blocks at a cost the interpreter can bear


@pytest.fixture
def small_block(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sample, "SAMPLE_BLOCK", SMALL_BLOCK)
    return SMALL_BLOCK


@pytest.mark.parametrize(
    ("rows", "vocab", "dtype"),
    [
        (5, 77, torch.float32),
        (3, SAMPLE_BLOCK + 1, torch.bfloat16),  # one token into the second block
        (7, 2 * SAMPLE_BLOCK + 3, torch.float16),
    ],
)
def test_greedy_rows_match_the_reference(rows: int, vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    # Few distinct values, so most rows' maximum is tied across positions and blocks.
    wide = torch.randint(0, 5, (rows, vocab + 9), generator=generator).to(dtype)
    wide[0, ::3] = float("-inf")
    logits = wide[:, :vocab]  # a strided slice, as a step's logit rows can be
    expected = reference.sample_rows(logits, None, seed=0)
    got = sample_rows(logits.to(DEVICE), None, seed=0).cpu()
    assert torch.equal(got, expected)
    # The same rows at temperature 0 inside a batch that samples: still greedy.
    temperature = torch.zeros(rows)
    got_mixed = sample_rows(logits.to(DEVICE), temperature.to(DEVICE), seed=1).cpu()
    assert torch.equal(got_mixed, expected)


def test_the_greedy_token_is_the_first_of_a_tie_across_blocks() -> None:
    vocab = 2 * SAMPLE_BLOCK + 5
    logits = torch.full((2, vocab), -1.0)
    logits[0, [SAMPLE_BLOCK + 7, 11, 2 * SAMPLE_BLOCK + 1]] = 3.0  # first in the first block
    logits[1, [2 * SAMPLE_BLOCK + 4, SAMPLE_BLOCK]] = 3.0  # first in the second block
    got = sample_rows(logits.to(DEVICE), None, seed=0).cpu()
    assert got.tolist() == [11, SAMPLE_BLOCK]


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


# The interpreter runs a program at a time (about 20 ms a row on the 2-core VM): fewer rows there,
# and one temperature.
DRAW_ROWS = 4000 if DEVICE == "cuda" else 300
TEMPERATURES = [0.7, 1.9] if DEVICE == "cuda" else [1.9]


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_draws_follow_the_softmax(temperature: float) -> None:
    rows, vocab = DRAW_ROWS, 101
    # Mass on five tokens; the rest forbidden (-inf, as a grammar mask leaves them).
    logits = torch.full((rows, vocab), float("-inf"))
    tokens = [3, 40, 41, 77, vocab - 1]
    values = torch.tensor([0.5, -0.3, 1.2, 0.0, 0.9])
    logits[:, tokens] = values
    expected = torch.softmax(values.double() / temperature, dim=0)
    for fn in (sample_rows, reference.sample_rows):
        drawn = fn(logits.to(DEVICE), torch.full((rows,), temperature, device=DEVICE), 7).cpu()
        freq = _frequencies(drawn, vocab)
        assert freq[tokens].sum().item() == pytest.approx(1.0)  # nothing forbidden was drawn
        for token, p in zip(tokens, expected.tolist()):
            bound = 5 * math.sqrt(p * (1 - p) / rows)
            assert abs(freq[token].item() - p) < bound, (fn.__module__, token, freq[token].item(), p)


def test_draws_compare_across_blocks(small_block: int) -> None:
    """Rows whose draw is certain, with their tokens in different blocks: the draw's running argmax
    carries over blocks as the greedy one does."""
    vocab = 3 * small_block + 5
    logits = torch.full((4, vocab), float("-inf"))
    logits[0, 2 * small_block + 1] = -3.0  # the one allowed token, in the third block
    logits[1, [5, small_block + 2]] = torch.tensor([0.0, 40.0])  # the later block's, by e^-40
    logits[2, [small_block - 1, 3 * small_block + 4]] = torch.tensor([40.0, 0.0])  # the earlier block's
    logits[3, 7] = 0.0  # temperature 0 in the batch: greedy, the row's only finite logit
    temperature = torch.tensor([5.0, 1.0, 1.0, 0.0])
    got = sample_rows(logits.to(DEVICE), temperature.to(DEVICE), seed=11).cpu()
    assert got.tolist() == [2 * small_block + 1, small_block + 2, small_block - 1, 7]


def test_seeds_key_the_draws() -> None:
    rows, vocab = 24, 501
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    temperature = torch.ones(rows, device=DEVICE)
    first = sample_rows(logits, temperature, seed=1234)
    assert torch.equal(sample_rows(logits, temperature, seed=1234), first)
    other = sample_rows(logits, temperature, seed=1235)
    assert (other != first).sum().item() > rows // 2  # a flat distribution: other seeds, other tokens
    assert ((first >= 0) & (first < vocab)).all()
