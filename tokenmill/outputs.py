"""What a caller gets back per request: the prompt, and one CompletionOutput per sample (n of them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    # Per generated token: {token_id: Logprob} holding the sampled token and the top-k alternatives.
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # Streaming deltas since the previous output of this request.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        """A method, as vLLM's CompletionOutput.finished() (RequestOutput.finished is a field)."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # When asked for (SamplingParams.prompt_logprobs): one entry per prompt token, None for the first,
    # each {token_id: Logprob} holding the prompt token and the top-k alternatives at that position.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The pooling runner's embedding of the prompt: float32 little-endian bytes, L2-normalised.
    pooled: bytes | None = None
    # Why the engine failed the request (its completions then end with finish_reason "abort"), e.g. a
    # disaggregated request whose KV never came from its prefill peer.
    error: str | None = None
    # vLLM's attributes that are None here as they are under vLLM's offline LLM (no per-request stats
    # logged, no LoRA, decoder-only models).
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None

    @property
    def embedding(self) -> list[float] | None:
        """The pooled vector as floats (None from a generating engine)."""
        if self.pooled is None:
            return None
        import numpy as np

        return np.frombuffer(self.pooled, dtype="<f4").tolist()


@dataclass(slots=True)
class PoolingOutput:
    data: Any  # torch.Tensor [hidden_size] float32, L2-normalised


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class PoolingRequestOutput:
    """What LLM.encode returns per prompt, in vLLM's shape: the pooled tensor is output.outputs.data."""

    request_id: str
    outputs: Any  # PoolingOutput (EmbeddingOutput for EmbeddingRequestOutput)
    prompt_token_ids: list[int]
    num_cached_tokens: int
    finished: bool = True

    @classmethod
    def from_output(cls, output: RequestOutput) -> PoolingRequestOutput:
        assert output.pooled is not None, "a pooling request finished without its vector"
        return cls(output.request_id, cls._outputs(output), output.prompt_token_ids, output.num_cached_tokens)

    @staticmethod
    def _outputs(output: RequestOutput) -> Any:
        import numpy as np
        import torch

        return PoolingOutput(torch.from_numpy(np.frombuffer(output.pooled, dtype="<f4").copy()))


@dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    """What LLM.embed returns per prompt, in vLLM's shape (a PoolingRequestOutput, as vLLM's is): the
    vector is output.outputs.embedding, a list of floats."""

    @staticmethod
    def _outputs(output: RequestOutput) -> Any:
        return EmbeddingOutput(output.embedding)
