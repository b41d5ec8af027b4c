"""One streamed OpenAI request over aiohttp, timed chunk by chunk from the server-sent events."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import aiohttp

from tokenmill.bench.tokenizer import BenchTokenizer

# vLLM's --backend names for the two OpenAI APIs ("vllm" is its older name for completions).
BACKENDS = ("openai", "vllm", "openai-chat")
# vLLM's sampling flags for `bench serve` (--top-p ...): each is sent under its own name when given.
SAMPLING_PARAMS = (
    ("temperature", float),
    ("top_p", float),
    ("top_k", int),
    ("min_p", float),
    ("frequency_penalty", float),
    ("presence_penalty", float),
    ("repetition_penalty", float),
)
COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"


class Endpoint(NamedTuple):
    path: str
    chat: bool
    backend: str  # the --backend name it answers to, as vLLM records it


def resolve_endpoint(backend: str | None, endpoint: str | None) -> Endpoint:
    """`--backend` and `--endpoint` -> the path to post to and which API it speaks.

    Either one decides: openai-chat defaults to /v1/chat/completions, openai to /v1/completions, and
    without --backend an endpoint ending in chat/completions is chat. Any path ending in completions
    works (a proxy's /openai/v1/completions); a backend and endpoint of different APIs are refused.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if endpoint is None:
        endpoint = CHAT_ENDPOINT if backend == "openai-chat" else COMPLETIONS_ENDPOINT
    if not endpoint.rstrip("/").endswith("completions"):
        raise ValueError(f"--endpoint must be a completions or chat/completions path, got {endpoint!r}")
    chat = endpoint.rstrip("/").endswith("chat/completions")
    if backend is not None and chat != (backend == "openai-chat"):
        wanted = CHAT_ENDPOINT if backend == "openai-chat" else COMPLETIONS_ENDPOINT
        raise ValueError(f"--backend {backend} speaks {wanted}, not --endpoint {endpoint}")
    return Endpoint(endpoint, chat, backend or ("openai-chat" if chat else "openai"))


@dataclass(frozen=True)
class RequestInput:
    """What to send: the prompt, the token budget, and where."""

    api_url: str
    model: str
    prompt: str | list[int]
    prompt_len: int
    max_tokens: int
    chat: bool = False
    ignore_eos: bool = False
    messages: tuple[dict, ...] | None = None  # a chat's turns; without them the prompt is one user turn
    extra_body: dict = field(default_factory=dict)  # sampling knobs and --extra-body, sent as given


@dataclass
class RequestResult:
    """What came back. Times are seconds; `start_time` is on the `time.perf_counter` clock."""

    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunk_chars: list[int] = field(default_factory=list)  # characters of text each chunk carried
    latency: float = 0.0
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def chunk_times(self) -> list[float]:
        """Arrival time of each content chunk on the perf_counter clock."""
        times = [self.start_time + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times if self.success else []


def build_payload(request: RequestInput) -> dict:
    payload: dict = {"model": request.model, "stream": True, "stream_options": {"include_usage": True}}
    if request.chat:
        if not isinstance(request.prompt, str):
            raise ValueError("/v1/chat/completions takes text prompts; drop --prompts-as-token-ids")
        turns = request.messages or ({"role": "user", "content": request.prompt},)
        payload["messages"] = list(turns)
        # Chat's own name for it (OpenAI deprecated max_tokens there), as vLLM's openai-chat backend sends.
        payload["max_completion_tokens"] = request.max_tokens
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.max_tokens
    if request.ignore_eos:
        payload["ignore_eos"] = True  # vLLM/SGLang/tokenmill extension to the OpenAI schema
    payload.update(request.extra_body)
    return payload


async def send_request(
    session: aiohttp.ClientSession,
    request: RequestInput,
    *,
    headers: dict[str, str] | None = None,
    tokenizer: BenchTokenizer | None = None,
) -> RequestResult:
    """Send one streaming request and time it; every failure is recorded, never raised."""
    result = RequestResult(prompt_len=request.prompt_len)
    usage_completion_tokens: int | None = None
    num_chunks = 0
    text_parts: list[str] = []
    result.start_time = last_time = last_choice_time = time.perf_counter()
    try:
        async with session.post(request.api_url, json=build_payload(request), headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {_error_message(await response.text())}"
                return result
            async for raw_line in response.content:
                now = time.perf_counter()
                line = raw_line.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, `event:` names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"stream error: {_error_message(json.dumps(chunk))}"
                    return result
                usage = chunk.get("usage")
                if usage:
                    usage_completion_tokens = usage.get("completion_tokens", usage_completion_tokens)
                    result.prompt_len = usage.get("prompt_tokens") or result.prompt_len
                if chunk.get("choices"):
                    last_choice_time = now  # the usage chunk and [DONE] after it do not end the answer
                text = _chunk_text(chunk, request.chat)
                if not text:
                    continue  # role-only deltas, finish_reason-only and usage chunks carry no token
                if num_chunks == 0:
                    result.ttft = now - result.start_time
                else:
                    result.itl.append(now - last_time)
                last_time = now
                num_chunks += 1
                text_parts.append(text)
                result.chunk_chars.append(len(text))
        result.latency = last_choice_time - result.start_time
    except Exception as exc:  # a benchmark counts failures; it must not stop on one
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result
    result.generated_text = "".join(text_parts)
    if num_chunks == 0:
        result.error = "the stream ended without any output token"
        return result
    result.output_tokens = _count_output_tokens(
        usage_completion_tokens, result.generated_text, num_chunks, tokenizer
    )
    result.success = True
    return result


def _chunk_text(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _count_output_tokens(
    usage_tokens: int | None, text: str, num_chunks: int, tokenizer: BenchTokenizer | None
) -> int:
    """The server's usage count if it sent one, else re-tokenise the text, else one token per chunk."""
    if usage_tokens is not None:
        return int(usage_tokens)
    if tokenizer is not None:
        return len(tokenizer.encode(text))
    return num_chunks


def _error_message(body: str) -> str:
    """The `message` of an OpenAI error object, or the raw body when it is not one."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:500]
    error = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)[:500]
