"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens. Text that copies from its
context (code edits, summaries that quote, retrieval answers) repeats runs of tokens; where the last n
tokens occurred before, the tokens that followed them then are a good guess for what follows now.

A proposal scans the request's whole text every step, so it is written for long contexts: one vectorised
comparison finds where the last token occurred before, and only those places are extended backwards
(an 8k-token request without a match: ~10 us, against ~600 us for a sliding-window search); each
request's tokens are kept as a growing array, so the text is not converted again every step."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(
        self, token_ids: list[int] | np.ndarray, max_tokens: int | None = None, request_id: str | None = None
    ) -> list[int]:
        """Up to k (and max_tokens) tokens that followed the latest earlier occurrence of the longest
        suffix of token_ids (of min_n to max_n tokens) that occurred before; [] when none did. With a
        request_id the tokens are kept between calls and only the new ones converted (forget() it at
        the end)."""
        limit = self.k if max_tokens is None else min(self.k, max_tokens)
        tokens = self._tokens(token_ids, request_id)
        length = tokens.shape[0]
        if limit <= 0 or length < self.min_n + 1:
            return []
        # Ends of earlier occurrences of the last token (never the suffix's own end), then of the last
        # two tokens, and so on while any remain.
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        best, n = None, 1
        while ends.size:
            if n >= self.min_n:
                best = ends
            if n == self.max_n:
                break
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
            n += 1
        if best is None:
            return []
        start = int(best[-1]) + 1
        return tokens[start : start + limit].tolist()

    def forget(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)

    def _tokens(self, token_ids: list[int] | np.ndarray, request_id: str | None) -> np.ndarray:
        if request_id is None or isinstance(token_ids, np.ndarray):
            return np.asarray(token_ids, dtype=np.int64)
        buffer, count = self._arrays.get(request_id, (np.empty(0, dtype=np.int64), 0))
        length = len(token_ids)
        if length < count:  # not this request's text any more (preempted and resumed shorter): restart
            count = 0
        if length > buffer.shape[0]:
            grown = np.empty(max(length, 2 * buffer.shape[0], 256), dtype=np.int64)
            grown[:count] = buffer[:count]
            buffer = grown
        if length > count:
            buffer[count:length] = token_ids[count:length]
        self._arrays[request_id] = (buffer, length)
        return buffer[:length]
