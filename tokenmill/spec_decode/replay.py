"""A proposer for measuring the speculation machinery itself: it proposes the tokens an earlier run of
the same requests produced (recorded greedy outputs), so every draft is accepted, or corrupts each draft
at a set rate to give a chosen acceptance. Benchmarks and tests only: it knows the answer."""

from __future__ import annotations

import random


class ReplayProposer:
    def __init__(
        self,
        runs: list[tuple[list[int], list[int]]],
        num_speculative_tokens: int,
        corrupt_rate: float = 0.0,
        seed: int = 0,
    ) -> None:
        """runs: (prompt, output) token ids of the earlier run. A request whose prompt is one of them gets
        the recorded output at its own position, whatever it generated meanwhile (if its text has left
        the recording, as low-precision numerics can make it, its drafts are simply rejected). A draft
        token is replaced by another one with probability corrupt_rate."""
        if not 0.0 <= corrupt_rate <= 1.0:
            raise ValueError(f"corrupt_rate must be in [0, 1], got {corrupt_rate!r}.")
        self.runs = [(list(prompt), list(prompt) + list(output)) for prompt, output in runs]
        self.k = num_speculative_tokens
        self.corrupt_rate = corrupt_rate
        self.rng = random.Random(seed)

    def forget(self, request_id: str) -> None:
        """Nothing kept per request."""

    def propose(
        self, token_ids: list[int], max_tokens: int | None = None, request_id: str | None = None
    ) -> list[int]:
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        length = len(token_ids)
        for prompt, sequence in self.runs:
            if length > len(prompt) and list(token_ids[: len(prompt)]) == prompt:
                drafts = sequence[length : length + max(limit, 0)]
                return [t + 1 if self.rng.random() < self.corrupt_rate else t for t in drafts]
        return []
