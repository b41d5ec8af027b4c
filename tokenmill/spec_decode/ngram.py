"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens. Text that copies from its
context (code edits, summaries that quote, retrieval answers) repeats runs of tokens; where the last n
tokens occurred before, the tokens that followed them then are a good guess for what follows now."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None) -> list[int]:
        """Up to k (and max_tokens) tokens that followed the latest earlier occurrence of the longest
        suffix of token_ids (of min_n to max_n tokens) that occurred before; [] when none did."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = tokens.shape[0]
        if limit <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows that start before the suffix itself and are followed by at least one token.
            windows = sliding_window_view(tokens[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + limit].tolist()
        return []
