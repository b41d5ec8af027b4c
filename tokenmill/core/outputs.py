"""What crosses between the engine core, the worker and the output processor, as small typed records."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """The sampled token's logprob, its rank, and the top-k alternatives (ids and logprobs)."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class ModelRunnerOutput:
    # One row per scheduled request, in the step's order.
    req_ids: list[str]
    # The tokens each row sampled that count: empty for a prompt chunk, one token, or with speculative
    # decoding the accepted drafts and the target's own next token.
    sampled_token_ids: list[list[int]]
    # Per row: the logprobs of each token in sampled_token_ids (None for rows that asked none).
    logprobs: list[list[TokenLogprobs] | None] | None = None
    # request id -> (position of the first prompt token scored, one entry per prompt token from there)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    # The pooling runner's vector per row (float32 little-endian bytes, L2-normalised): set for the rows
    # whose prompt this step finished, None for the others.
    pooled: list[bytes | None] | None = None
    # Speculative decoding: per row, the drafts proposed for the request's next step ([] for none).
    spec_token_ids: list[list[int]] | None = None

    def result(self) -> ModelRunnerOutput:
        """Executors may return a pending output whose result() waits for the device; this one is ready."""
        return self


# How EngineCoreOutput.error begins for a request whose grammar failed mid-answer (its stream raises
# RequestFailedError, not the KV transfer's error).
GRAMMAR_FAILED = "structured_outputs: the grammar failed"


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # With the first token only, when asked for: entry i scores prompt token i + 1 given those before it.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # The pooling runner's vector (float32 little-endian, L2-normalised), with finish reason "stop" and no
    # tokens: an embedding request ends when its prompt has been computed.
    pooled: bytes | None = None
    # Why the engine failed the request, with finish reason "abort": a disaggregated request whose KV never
    # came from its prefill peer, or one whose grammar failed (starting GRAMMAR_FAILED). None for a request
    # that ended normally or was aborted by its client.
    error: str | None = None
