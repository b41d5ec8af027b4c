"""POST /v1/chat/completions: chat template -> token ids -> engine, answered whole or streamed as SSE
(a role chunk per choice, content deltas, a finish chunk, the usage chunk if asked for, then [DONE])."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.serving.prompt import RenderedPrompt, render_prompt
from tokenmill.thinking import prompt_thinking

from .common import (
    SSE_DONE,
    DisconnectWatcher,
    ServerState,
    aborted_error,
    check_constraint,
    error_event,
    final_outputs,
    resolve_max_tokens,
    sse,
    usage,
)
from .errors import bad_request, to_openai_error
from .logprobs import chat_logprobs, reported_logprobs, vllm_prompt_logprobs
from .protocol import ChatCompletionRequest, ChatMessage
from .reasoning import ReasoningParser, StreamSplitter
from .tool_calls import PARSERS, calls_from_constrained, keep_marker, tool_constraint
from .tool_stream import ToolStream


def render_chat(
    tokenizer,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    tools: list | None = None,
    encode: Callable[[str], list[int]] | None = None,
    continue_final_message: bool = False,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
) -> RenderedPrompt:
    """The conversation through the model's chat template (or the request's own); tools (and earlier calls
    and results) go where the template puts them, or into the system message when it has no place for
    them. encode: the server's ChatEncoder (earlier turns tokenized once), else the tokenizer's own.
    continue_final_message: the last (assistant) message left open for the model to continue."""
    dicts = [m.template_dict() for m in messages]
    try:
        return render_prompt(
            tokenizer, messages=dicts, add_generation_prompt=add_generation_prompt, tools=tools,
            encode=encode, continue_final_message=continue_final_message, chat_template=chat_template,
            template_kwargs=template_kwargs,
        )  # fmt: skip
    except ValueError as exc:
        raise bad_request(str(exc), param="messages" if tokenizer is not None else None) from exc


def chat_encoder(state, request: ChatCompletionRequest) -> Callable[[str], list[int]] | None:
    """How a request's rendered chat becomes token ids: the server's ChatEncoder (earlier turns tokenized
    once) under the model's own template, the tokenizer's encode under the request's; with vLLM's
    add_special_tokens, the tokenizer's encode adding its special tokens (a BOS) to the template's."""
    if request.add_special_tokens:
        tokenizer = state.engine.tokenizer
        return lambda text: list(tokenizer.encode(text, add_special_tokens=True))
    return state.encode_chat if request.chat_template is None else None


class ToolAnswer:
    """A choice's text as the answer tool_choice asks for: plain content, or tool calls (a grammar's
    output under required or a named function, a parser's find under auto) with finish_reason
    tool_calls, but `stop` under a named function, as OpenAI's API answers (streamed or not)."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        parser_name: str | None,
        reasoning_parser: str | None = None,
        role: str = "assistant",
        thinking: str | None = None,
    ) -> None:
        self.role = role
        self.mode = request.tool_mode
        self.tool_choice = request.tool_choice
        self.parallel = request.parallel_tool_calls
        self.parser_name = parser_name
        self.parser = PARSERS[parser_name]() if self.mode == "auto" and parser_name else None
        # A model's thinking goes to reasoning_content, only its answer on to the tool parser; thinking:
        # what the rendered prompt did with it (tokenmill.thinking.prompt_thinking).
        self.reasoning = ReasoningParser(reasoning_parser, thinking) if reasoning_parser else None

    @property
    def plain(self) -> bool:
        """Whether a stream's deltas go out as they come (no tools, no reasoning to route)."""
        return self.mode == "none" and self.reasoning is None

    def stream(self) -> ToolStream:
        return ToolStream(self.mode, self.tool_choice, self.parser_name, self.parallel)

    def split(self, text: str) -> tuple[str | None, list]:
        if self.mode in ("required", "named"):
            # The grammar's text is never content, even cut by max_tokens before a whole call.
            try:
                return None, calls_from_constrained(text, self.tool_choice)
            except (ValueError, KeyError, TypeError):
                return None, []
        if self.parser is not None:
            return self.parser.parse(text)
        return text, []

    def message(self, text: str, finish_reason: str | None) -> dict:
        """{"message": ..., "finish_reason": ...} of a finished choice."""
        thinking = {}
        if self.reasoning is not None:
            reasoning, text = self.reasoning.split(text)
            thinking = {"reasoning_content": reasoning}
        content, calls = self.split(text)
        if not calls:
            # All of it thinking (no </think> under deepseek_r1): no answer, null as vLLM's, not "".
            answer = content if content or self.reasoning is None else None
            message = {"role": self.role, "content": answer, **thinking}
            return {"message": message, "finish_reason": finish_reason}
        calls = calls if self.parallel else calls[:1]
        message = {"role": self.role, "content": content, **thinking}
        message["tool_calls"] = [c.to_openai(self.parser_name) for c in calls]
        return {"message": message, "finish_reason": self.finish_reason(finish_reason)}

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A choice's finish_reason once it holds calls."""
        return "tool_calls" if engine_reason == "stop" and self.mode != "named" else engine_reason


def _usage(final: RequestOutput) -> dict:
    generated = sum(len(c.token_ids) for c in final.outputs)
    return usage(len(final.prompt_token_ids), generated, final.num_cached_tokens)


class ChatServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        start = time.monotonic()
        state = self.state
        model = state.check_model(request.model)
        state.check_generates()
        state.check_accepting()
        engine = state.engine
        mode = request.tool_mode
        if mode == "auto" and not (state.enable_auto_tool_choice and state.tool_call_parser):
            raise bad_request(
                "tool_choice 'auto' (the default with tools) needs the server started with "
                "--enable-auto-tool-choice and --tool-call-parser; or pass tool_choice 'none', 'required' "
                "or a named function",
                param="tool_choice",
            )
        prompt_text, prompt_ids = await state.off_loop(
            render_chat,
            engine.tokenizer,
            request.messages,
            request.add_generation_prompt,
            request.tools,
            chat_encoder(state, request),
            request.continue_final_message,
            request.chat_template,
            request.chat_template_kwargs,
        )
        defaults = state.default_sampling
        max_tokens = resolve_max_tokens(
            len(prompt_ids), request.requested_max_tokens, engine.max_model_len, "messages",
            defaults.get("max_tokens"),  # type: ignore[arg-type]
        )  # fmt: skip
        params = request.sampling_params(max_tokens, request.num_logprobs, request.prompt_logprobs, defaults)
        keep_marker(params, mode, state.tool_call_parser)
        if mode in ("required", "named"):
            params.structured_outputs = tool_constraint(
                request.tools, request.tool_choice, request.parallel_tool_calls
            )
        # Whether the chat template opened the thinking or closed it: the split and the constraint follow.
        messages = [m.template_dict() for m in request.messages]
        thinking = prompt_thinking(prompt_text, messages) if state.reasoning_parser else None
        if state.reasoning_parser and params.structured_outputs is not None:
            # The constraint is the answer's: the thinking before it goes free.
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, reasoning=state.reasoning_parser, prompt_thinking=thinking
            )
        await check_constraint(state, request, params)
        # vLLM's: the server's role for a reply; the last message's when that message is continued.
        role = state.response_role if request.add_generation_prompt else request.messages[-1].role
        tools = ToolAnswer(request, state.tool_call_parser, state.reasoning_parser, role, thinking)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        state.log_request(request_id, prompt_text, prompt_ids, params)
        state.metrics.record_intake(time.monotonic() - start)
        remote = await state.remote_prefill(prompt_ids, params, request.n, request.cache_salt)
        stream = engine.add_request(
            request_id, prompt_ids, params, prompt_text, remote_prefill=remote,
            cache_salt=request.cache_salt, priority=request.priority,
        )  # fmt: skip
        head = {"id": request_id, "created": int(time.time()), "model": model}
        if request.stream:
            return StreamingResponse(
                self._stream(head, request, request_id, stream, raw_request, tools, len(prompt_ids)),
                media_type="text/event-stream",
            )
        (final,) = await final_outputs(engine, {request_id: stream}, raw_request)
        k = request.num_logprobs
        choices = [
            {
                "index": c.index,
                **tools.message(c.text, c.finish_reason),
                "logprobs": chat_logprobs(
                    reported_logprobs(c, c.token_ids, c.logprobs, self.state.eos_token_ids), k
                )
                if k is not None and c.logprobs
                else None,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ]
        body = {**head, "object": "chat.completion", "choices": choices, "usage": _usage(final)}
        if request.prompt_logprobs is not None and final.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(final.prompt_logprobs, request.prompt_logprobs)
        return JSONResponse(body)

    async def _stream(
        self,
        head: dict,
        request: ChatCompletionRequest,
        request_id: str,
        stream: AsyncIterator[RequestOutput],
        raw_request: Request,
        tools: ToolAnswer,
        num_prompt_tokens: int,
    ) -> AsyncIterator[str]:
        engine = self.state.engine
        watcher = DisconnectWatcher(raw_request, lambda: engine.abort(request_id))
        k = request.num_logprobs

        def chunk(choices: list[dict], completion_tokens: int = 0, **extra: object) -> str:
            # With include_usage every chunk carries "usage": null until the last, as OpenAI sends it;
            # with vLLM's continuous_usage_stats, its choice's counts so far.
            running = usage(num_prompt_tokens, completion_tokens, None) if request.continuous_usage else None
            head_usage = {"usage": running} if request.include_usage else {}
            return sse({**head, "object": "chat.completion.chunk", "choices": choices, **head_usage, **extra})

        def choice(
            index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None
        ) -> dict:
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

        try:
            for index in range(request.n):  # one choice per chunk, as clients reading choices[0] expect
                yield chunk([choice(index, {"role": tools.role, "content": ""})])
            final, finished = None, set()
            texts: dict[int, str] = {}
            splitters: dict[int, StreamSplitter] = {}
            streams: dict[int, ToolStream] = {}
            async for output in stream:
                final = output
                for c in output.outputs:
                    if c.index in finished:
                        continue
                    token_logprobs = reported_logprobs(
                        c, c.delta_token_ids, c.delta_logprobs, self.state.eos_token_ids
                    )
                    logprobs = chat_logprobs(token_logprobs, k) if token_logprobs else None
                    done = c.finish_reason is not None
                    deltas = []
                    if tools.plain:
                        deltas = [{"content": c.delta_text}] if c.delta_text else []
                    elif c.delta_text or done:
                        # The text streamed so far (c.text may hold a stop string's withheld tail).
                        text = texts[c.index] = texts.get(c.index, "") + c.delta_text
                        if tools.reasoning is not None:  # the thinking first, then the answer
                            splitter = splitters.setdefault(c.index, StreamSplitter(tools.reasoning))
                            thought = splitter.delta(text, done).get("reasoning_content")
                            deltas = [{"reasoning_content": thought}] if thought else []
                            text = splitter.content
                        deltas += streams.setdefault(c.index, tools.stream()).feed(text, done)
                    if logprobs and not deltas:
                        deltas = [{"content": ""}]
                    for n, delta in enumerate(deltas):
                        yield chunk([choice(c.index, delta, logprobs if n == 0 else None)], len(c.token_ids))
                    if done:
                        finished.add(c.index)
                        finish_reason = c.finish_reason
                        calls = streams[c.index].calls if c.index in streams else 0
                        if calls:
                            finish_reason = tools.finish_reason(finish_reason)
                        yield chunk(
                            [{**choice(c.index, {}, None, finish_reason), "stop_reason": c.stop_reason}],
                            len(c.token_ids),
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
