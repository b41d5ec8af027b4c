"""POST /v1/chat/completions: chat template -> token ids -> engine, answered whole or streamed as SSE
(a role chunk per choice, content deltas, a finish chunk, the usage chunk if asked for, then [DONE])."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.serving.prompt import RenderedPrompt, render_prompt

from .common import (
    SSE_DONE,
    DisconnectWatcher,
    ServerState,
    aborted_error,
    chat_logprobs,
    check_constraint,
    error_event,
    final_outputs,
    reported_tokens,
    resolve_max_tokens,
    sse,
    usage,
)
from .errors import bad_request, to_openai_error
from .protocol import ChatCompletionRequest, ChatMessage


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool) -> RenderedPrompt:
    try:
        return render_prompt(
            tokenizer,
            messages=[m.template_dict() for m in messages],
            add_generation_prompt=add_generation_prompt,
        )
    except ValueError as exc:
        raise bad_request(str(exc), param="messages" if tokenizer is not None else None) from exc


def _usage(final: RequestOutput) -> dict:
    generated = sum(len(c.token_ids) for c in final.outputs)
    return usage(len(final.prompt_token_ids), generated, final.num_cached_tokens)


class ChatServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        state.check_generates()
        state.check_accepting()
        engine = state.engine
        prompt_text, prompt_ids = await state.off_loop(
            render_chat, engine.tokenizer, request.messages, request.add_generation_prompt
        )
        max_tokens = resolve_max_tokens(
            len(prompt_ids), request.requested_max_tokens, engine.max_model_len, "messages"
        )
        params = request.sampling_params(max_tokens, request.num_logprobs)
        await check_constraint(state, request, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = engine.add_request(request_id, prompt_ids, params, prompt_text)
        head = {"id": request_id, "created": int(time.time()), "model": model}
        if request.stream:
            return StreamingResponse(
                self._stream(head, request, request_id, stream, raw_request), media_type="text/event-stream"
            )
        (final,) = await final_outputs(engine, {request_id: stream}, raw_request)
        k = request.num_logprobs
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(*reported_tokens(c, c.token_ids, c.logprobs), k)
                if k is not None and c.logprobs
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": _usage(final)})

    async def _stream(
        self,
        head: dict,
        request: ChatCompletionRequest,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
        raw_request: Request,
    ) -> AsyncIterator[str]:
        engine = self.state.engine
        watcher = DisconnectWatcher(raw_request, lambda: engine.abort(request_id))
        k = request.num_logprobs

        def chunk(choices: list[dict], **extra: object) -> str:
            # With include_usage every chunk carries "usage": null until the last, as OpenAI sends it.
            usage = {"usage": None} if request.include_usage else {}
            return sse({**head, "object": "chat.completion.chunk", "choices": choices, **usage, **extra})

        def choice(
            index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None
        ) -> dict:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

        try:
            for index in range(request.n):  # one choice per chunk, as clients reading choices[0] expect
                yield chunk([choice(index, {"role": "assistant", "content": ""})])
            final, finished = None, set()
            async for output in stream:
                final = output
                for c in output.outputs:
                    if c.index in finished:
                        continue
                    token_ids, token_logprobs = reported_tokens(c, c.delta_token_ids, c.delta_logprobs)
                    logprobs = chat_logprobs(token_ids, token_logprobs, k) if token_logprobs else None
                    if c.delta_text or logprobs:
                        yield chunk([choice(c.index, {"content": c.delta_text}, logprobs)])
                    if c.finish_reason is not None:
                        finished.add(c.index)
                        yield chunk(
                            [{**choice(c.index, {}, None, c.finish_reason), "stop_reason": c.stop_reason}]
                        )
            if final is None or not final.finished:
                if not watcher.disconnected:
                    yield error_event(aborted_error())
            elif request.include_usage:
                yield chunk([], usage=_usage(final))
        except Exception as exc:
            yield error_event(to_openai_error(exc))
        finally:
            watcher.stop()
            engine.abort(request_id)
        yield SSE_DONE
