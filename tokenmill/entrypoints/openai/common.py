"""What the chat and completion handlers share: the server's state and admission checks, the context-length
check, usage and logprobs objects, SSE framing, and aborting a request the moment its client disconnects."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
from starlette.requests import Request

from tokenmill.core.kv_transfer import RemotePrefill
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.serving.async_client import AsyncEngineClient
from tokenmill.serving.chat_encoder import ChatEncoder
from tokenmill.serving.metrics import ServerMetrics
from tokenmill.serving.prompt import RenderedPrompt, render_prompt

from .disagg import PrefillPeers
from .errors import OpenAIError, bad_request, unavailable

T = TypeVar("T")
logger = logging.getLogger("tokenmill.server")

SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServerState:
    engine: AsyncEngineClient
    served_model_names: list[str]
    metrics: ServerMetrics
    api_key: str | None = None
    draining: bool = False
    tool_call_parser: str | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None  # --reasoning-parser
    # Sampling defaults of requests that leave a knob unset (--generation-config; generation_config.py).
    default_sampling: dict[str, float | int] = field(default_factory=dict)
    response_role: str = "assistant"  # --response-role
    log_requests: bool = False  # --enable-log-requests
    # Prefill/decode disaggregation (disagg.py): a decode instance's prefill peers; a prefill
    # instance's KV address, returned to decode peers.
    prefill_peers: PrefillPeers | None = None
    kv_address: str | None = None
    # Chat templates, tokenizing and detokenizing run on one worker thread, not on the event loop: a
    # megabyte prompt takes seconds, and every other stream and /health would wait for it.
    text_worker: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenmill-text")
    )
    # Tokenizes rendered chats from cached pieces (earlier turns once), on the text worker only.
    chat_encoder: ChatEncoder | None = None

    def __post_init__(self) -> None:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if self.chat_encoder is None and tokenizer is not None:
            self.chat_encoder = ChatEncoder(tokenizer)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.engine, "eos_token_ids", ()))

    @property
    def encode_chat(self) -> Callable[[str], list[int]] | None:
        return self.chat_encoder.encode if self.chat_encoder is not None else None

    async def remote_prefill(
        self, token_ids: list[int], params: SamplingParams, n: int, cache_salt: str | None
    ) -> RemotePrefill | None:
        """On a decode instance, a prompt long enough goes to a prefill peer first (disagg.py)."""
        peers = self.prefill_peers
        if peers is None or not peers.eligible(token_ids, params, n):
            return None
        return await peers.prefill(token_ids, params, cache_salt)

    def log_request(
        self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams
    ) -> None:
        if self.log_requests:
            logger.info(
                "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
                request_id, prompt, params, token_ids,
            )  # fmt: skip

    async def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.text_worker, fn, *args)

    def check_model(self, model: str | None) -> str:
        """The name to report back; an unknown model is a 404, as OpenAI answers it."""
        if model is None:
            return self.served_model_names[0]
        if model not in self.served_model_names:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist.",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return model

    def check_generates(self) -> None:
        """Text endpoints need a generating engine; a pooling one serves /v1/embeddings only."""
        if self.engine.pooling_type is not None:
            raise bad_request(
                "this server runs the pooling runner (--runner pooling): it serves /v1/embeddings, not "
                "text generation.",
                param="model",
            )

    def check_accepting(self) -> None:
        if self.engine.dead_error is not None:
            raise unavailable(self.engine.dead_error, "engine_dead")
        if self.draining:
            raise unavailable("the server is shutting down and accepts no new requests.", "draining")


def render_input(
    tokenizer, prompt: str | list[int], index: int, param: str, add_special_tokens: bool = True
) -> RenderedPrompt:
    """One prompt (text or token ids) of a request's list, tokenized; a bad or empty one is a 400 naming
    `param` and its position."""
    try:
        rendered = render_prompt(tokenizer, prompt, add_special_tokens=add_special_tokens)
    except ValueError as exc:
        raise bad_request(str(exc), param=param) from exc
    if not rendered.token_ids:
        raise bad_request(f"{param} {index} is empty.", param=param)
    return rendered


async def check_constraint(state: ServerState, request, params) -> None:
    """The request's output constraint compiled off the event loop (cached by its text): a schema,
    regex or grammar llguidance rejects is a 400 naming the request field it came from."""
    if params.structured_outputs is None:
        return
    try:
        await state.off_loop(state.engine.input_processor.check_structured, params)
    except ValueError as exc:
        # A constraint the request gave names its field; one made from tools names them.
        field = request.constraint[0] if request.constraint else "tools"
        raise bad_request(str(exc), param=field) from None


def resolve_max_tokens(
    num_prompt_tokens: int, requested: int | None, max_model_len: int, what: str, default: int | None = None
) -> int:
    """max_tokens as given (or all the room left), at most `default` (the generation config's, as vLLM
    caps it); a prompt plus the requested completion over the context is a 400."""
    if requested is None:
        if num_prompt_tokens < max_model_len:
            return min(max_model_len - num_prompt_tokens, default or max_model_len)
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your {what} "
            f"{'is' if what == 'prompt' else 'are'} {num_prompt_tokens} tokens, which leaves no room for "
            f"the completion. Please reduce the length of the {what}.",
            param=what,
            code="context_length_exceeded",
        )
    if num_prompt_tokens + requested > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {what}, {requested} in the "
            f"completion). Please reduce the length of the {what} or completion.",
            param=what,
            code="context_length_exceeded",
        )
    return min(requested, default or requested)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    """A usage object; cached_tokens None (a stream's running count, as vLLM sends it) leaves out the
    prompt's details."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is None:
        return counts
    return {**counts, "prompt_tokens_details": {"cached_tokens": cached_tokens}}


_json_encoder = msgspec.json.Encoder()


def sse(payload: dict) -> str:
    """One server-sent event; msgspec writes the JSON (UTF-8, not ASCII-escaped) several times faster
    than the json module, and a busy server writes one of these per token per stream."""
    return "data: " + _json_encoder.encode(payload).decode() + "\n\n"


def error_event(exc: OpenAIError) -> str:
    """An error after the stream began: the status line is long gone, so it travels as an event."""
    return sse(exc.body())


def aborted_error() -> OpenAIError:
    return unavailable("the request was aborted before it finished (the server is shutting down).", "aborted")


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


class DisconnectWatcher:
    """Aborts requests the moment their client disconnects, rather than when the next token fails to
    send: a client that leaves before its first token frees its KV blocks at once."""

    def __init__(self, raw_request: Request, on_disconnect: Callable[[], None]) -> None:
        self.disconnected = False
        self._on_disconnect = on_disconnect
        self._task = asyncio.create_task(self._listen(raw_request))

    async def _listen(self, raw_request: Request) -> None:
        # The body has been read already, so the next ASGI message is the disconnect.
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        self._on_disconnect()

    def stop(self) -> None:
        self._task.cancel()


async def final_outputs(
    engine: AsyncEngineClient, streams: dict[str, AsyncIterator[RequestOutput]], raw_request: Request
) -> list[RequestOutput]:
    """Run requests to the end (non-streaming), aborting all of them if the client goes away."""
    watcher = DisconnectWatcher(raw_request, lambda: [engine.abort(request_id) for request_id in streams])

    async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        final = None
        async for output in stream:
            final = output
        return final

    try:
        results = await asyncio.gather(*(last(stream) for stream in streams.values()))
    finally:
        watcher.stop()
        for request_id in streams:
            engine.abort(request_id)
    if any(result is None or not result.finished for result in results):
        raise aborted_error()
    return results  # type: ignore[return-value]


async def merge_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come, tagged with the request's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
