"""A benchmark request as the load generator sends it, and random prompts of exact token lengths."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.bench.tokenizer import BenchTokenizer


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: text or token ids, its length in tokens, and how many tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    timestamp_ms: float | None = None
    # A chat endpoint's turns ({"role", "content"} each), where the workload is a conversation; `prompt`
    # then holds the same contents joined, and `prompt_len` their tokens without the template's own.
    messages: tuple[dict, ...] | None = None


class PromptMaker:
    """Random token ids (special tokens excluded) and text that re-encodes to an exact length."""

    def __init__(self, tokenizer: BenchTokenizer, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        # Only ids that decode to clean text alone: partial UTF-8 byte tokens decode to U+FFFD,
        # which re-encodes to other tokens and keeps a prompt from ever reaching its exact length.
        special = tokenizer.special_token_ids
        self._ids = np.asarray(
            [
                token_id
                for token_id in range(tokenizer.vocab_size)
                if token_id not in special and _is_clean(tokenizer.decode([token_id]))
            ],
            dtype=np.int64,
        )

    def random_ids(self, num_tokens: int) -> list[int]:
        return self.rng.choice(self._ids, size=num_tokens).tolist()

    def fit_text(self, token_ids: list[int], target_len: int) -> tuple[str, int]:
        """Decode, then re-encode (as vLLM does), trimming or topping up until the length is exact.

        Decoded ids can merge or split on re-encoding; a few rounds settle it. Returns the text and
        its true token count, which is `target_len` unless the rounds ran out.
        """
        ids = token_ids[:target_len]
        text = self.tokenizer.decode(ids)
        for _ in range(8):
            reencoded = self.tokenizer.encode(text)
            if len(reencoded) == target_len:
                return text, target_len
            if len(reencoded) > target_len:
                ids = reencoded[:target_len]
            else:
                ids = reencoded + self.random_ids(target_len - len(reencoded))
            text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text))

    def prompt(self, token_ids: list[int], as_token_ids: bool) -> tuple[str | list[int], int]:
        if as_token_ids:
            return token_ids, len(token_ids)
        return self.fit_text(token_ids, len(token_ids))


def _is_clean(text: str) -> bool:
    return bool(text) and "\ufffd" not in text
