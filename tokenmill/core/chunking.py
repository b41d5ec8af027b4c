"""How long a prompt chunk fits a step's token budget when each of its tokens also pays for the earlier
tokens it attends to: where a step's cost is its arithmetic (a CPU), a chunk deep into a long prompt is
shorter, so every step takes about the same time."""

from __future__ import annotations

import math


def chunk_within(
    context_cost: float, start: int, num_wanted: int, budget: int, fresh: bool = False
) -> tuple[int, int]:
    """(tokens, cost) of the longest run of at most num_wanted tokens from position `start` whose cost
    fits the budget. A token costs 1, plus context_cost per earlier token it attends to when it is part
    of a prompt chunk (num_wanted > 1). A fresh step always moves."""
    if num_wanted <= 1 or not context_cost:
        num_new = min(num_wanted, budget)
        return num_new, num_new
    # The largest n with n + context_cost * n * (start + n / 2) <= budget, then stepped down past the
    # rounding of chunk_cost.
    a, b = context_cost, 1 + context_cost * start
    num_new = min(num_wanted, int((math.sqrt(b * b + 2 * a * budget) - b) / a))
    while num_new > 0 and chunk_cost(context_cost, start, num_new) > budget:
        num_new -= 1
    if num_new == 0 and fresh:
        return 1, max(1, budget)
    return num_new, chunk_cost(context_cost, start, num_new)


def chunk_cost(context_cost: float, start: int, num_tokens: int) -> int:
    return num_tokens + math.ceil(context_cost * num_tokens * (start + num_tokens / 2))
