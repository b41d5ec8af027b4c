"""The logprobs objects of the OpenAI responses (chat's content list, completions' parallel arrays, echo's
prompt entries, vLLM's prompt_logprobs) from the engine's {token id: Logprob} entries."""

from __future__ import annotations

from tokenmill.outputs import CompletionOutput, Logprob


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: item[1].rank)[:k]


# What a response reports for a token no sampling could pick (-inf: masked by a grammar, or cut by top-k
# / top-p before logprobs were taken): JSON has no infinity, and OpenAI's clients read floats. vLLM's figure.
LOGPROB_FLOOR = -9999.0


def _reported(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def _token_text(token_id: int, logprob: Logprob) -> str:
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def reported_logprobs(
    completion: CompletionOutput, token_ids: list[int], logprobs: list | None, eos_token_ids: frozenset[int]
) -> list | None:
    """The logprob entries a response reports (of token_ids, the tokens these entries end with): an EOS
    token that ended the completion is not part of its text, and OpenAI reports no logprob for it.
    (Offline outputs keep it, as vLLM's do.) A completion its grammar ended also stops without a stop
    reason, on a token of its text. Entries may be fewer than tokens: those of a stop string's tokens
    are not reported (serving/output_processor.py)."""
    if (
        logprobs
        and completion.finish_reason == "stop"
        and completion.stop_reason is None
        and token_ids
        and token_ids[-1] in eos_token_ids
    ):
        return logprobs[:-1]
    return logprobs


def _sampled(entry: dict[int, Logprob]) -> tuple[int, Logprob]:
    """An entry's sampled token: its first (the top alternatives follow it)."""
    return next(iter(entry.items()))


def chat_logprobs(logprobs: list[dict[int, Logprob]], k: int) -> dict:
    content = []
    for entry in logprobs:
        token_id, sampled = _sampled(entry)
        text = _token_text(token_id, sampled)
        content.append(
            {
                "token": text,
                "logprob": _reported(sampled.logprob),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(tid, lp)),
                        "logprob": _reported(lp.logprob),
                        "bytes": list(t.encode()),
                    }
                    for tid, lp in _top(entry, k)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(logprobs: list[dict[int, Logprob]], text_offset: int) -> dict:
    """The legacy completions shape: parallel lists, top alternatives as {token text: logprob}."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in logprobs:
        token_id, sampled = _sampled(entry)
        text = _token_text(token_id, sampled)
        tokens.append(text)
        token_logprobs.append(_reported(sampled.logprob))
        top_logprobs.append({_token_text(tid, lp): _reported(lp.logprob) for tid, lp in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def echo_logprobs(prompt_logprobs: list[dict[int, Logprob] | None], first_token_text: str) -> dict:
    """The prompt's part of an echoed completion's logprobs: the first token has no logprob (nothing
    precedes it), every later one is scored given the tokens before it."""
    scored = completion_logprobs(prompt_logprobs[1:], len(first_token_text))
    return {
        "tokens": [first_token_text] + scored["tokens"],
        "token_logprobs": [None] + scored["token_logprobs"],
        "top_logprobs": [None] + scored["top_logprobs"],
        "text_offset": [0] + scored["text_offset"],
    }


def top_of(entry: dict[int, Logprob], k: int) -> dict[int, Logprob]:
    """A prompt position's entry cut to its own token (first) and the top k: the engine scored the most
    any field of the request asked for (echo's logprobs, prompt_logprobs)."""
    own = next(iter(entry))
    return {tid: lp for tid, lp in entry.items() if tid == own or lp.rank <= k}


def vllm_prompt_logprobs(prompt_logprobs: list[dict[int, Logprob] | None], k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token, then per token {token_id: {"logprob", "rank",
    "decoded_token"}} of the token itself and the top k alternatives."""
    return [
        None
        if entry is None
        else {
            tid: {"logprob": _reported(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in top_of(entry, k).items()
        }
        for entry in prompt_logprobs
    ]


def join_logprobs(head: dict, tail: dict | None) -> dict:
    if tail is None:
        return head
    return {key: head[key] + tail[key] for key in head}
