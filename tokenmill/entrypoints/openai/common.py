"""What the chat and completion handlers share: the server's state and admission checks, the context-length
check, usage objects, SSE framing, and aborting a request the moment its client disconnects."""

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
from tokenmill.outputs import RequestOutput
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
        # A constraint the request gave names its field; one made from tools names them; a knob checked
        # against the constraint (allowed_token_ids) names itself.
        knob = getattr(exc, "param", None)
        if knob is not None:
            raise bad_request(str(exc), param=knob) from None
        field = request.constraint[0] if request.constraint else "tools"
        message, prefix = str(exc), f"structured_outputs {params.structured_outputs.kind}: "
        if field != "structured_outputs" and message.startswith(prefix):  # the field the client wrote
            message = f"{field}: {message[len(prefix) :]}"
        raise bad_request(message, param=field) from None


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
