"""Perplexity of a text under an engine, from prompt logprobs: the quality yardstick for quantization
(the same tokens scored by each scheme, so their perplexities compare directly)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmill.sampling_params import SamplingParams


def perplexity(llm, token_ids: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of token_ids[1:] given the tokens before each, in one
    window (the text must fit the engine's max_model_len)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    (output,) = llm.generate(prompt_token_ids=[list(token_ids)], sampling_params=params, use_tqdm=False)
    logprobs = [entry[token].logprob for token, entry in zip(token_ids[1:], output.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))
