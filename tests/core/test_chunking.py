"""Prompt chunks sized by what their tokens cost, context included."""

from __future__ import annotations

import pytest

from tokenmill.core.chunking import chunk_cost, chunk_within


def test_without_a_context_cost_a_token_costs_one() -> None:
    assert chunk_within(0.0, 5000, 800, 512) == (512, 512)
    assert chunk_within(0.0, 0, 100, 512) == (100, 100)


def test_a_decode_token_costs_one_whatever_its_context() -> None:
    assert chunk_within(0.01, 100_000, 1, 512) == (1, 1)


@pytest.mark.parametrize("context_cost", [1e-4, 3e-3, 0.05])
@pytest.mark.parametrize("start", [0, 1, 777, 8000, 100_000])
@pytest.mark.parametrize("budget", [1, 16, 512, 2048])
def test_the_longest_chunk_that_fits(context_cost: float, start: int, budget: int) -> None:
    num_wanted = 10_000
    num_new, cost = chunk_within(context_cost, start, num_wanted, budget)
    assert cost == chunk_cost(context_cost, start, num_new) <= budget
    assert num_new == num_wanted or chunk_cost(context_cost, start, num_new + 1) > budget
    # Deeper into the prompt, never longer.
    assert chunk_within(context_cost, start + 4096, num_wanted, budget)[0] <= num_new


def test_a_fresh_step_always_moves() -> None:
    assert chunk_within(0.05, 100_000, 500, 16) == (0, 0)
    assert chunk_within(0.05, 100_000, 500, 16, fresh=True) == (1, 16)


def test_the_prompt_end_bounds_the_chunk() -> None:
    assert chunk_within(1e-4, 0, 37, 512) == (37, chunk_cost(1e-4, 0, 37))
