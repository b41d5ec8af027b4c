"""POST /v1/completions: prompts as text, a list of texts, token ids or lists of token ids; each prompt is
one engine request and its samples are choices prompt_index * n + sample_index, as OpenAI numbers them."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import CompletionOutput, RequestOutput

from .common import (
    SSE_DONE,
    DisconnectWatcher,
    ServerState,
    aborted_error,
    check_constraint,
    error_event,
    final_outputs,
    merge_streams,
    render_input,
    resolve_max_tokens,
    sse,
    usage,
)
from .disagg import remote_decode_wanted
from .errors import bad_request, to_openai_error
from .logprobs import (
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    reported_logprobs,
    top_of,
    vllm_prompt_logprobs,
)
from .protocol import CompletionRequest


class _Prompt(NamedTuple):
    token_ids: list[int]
    text: str | None  # None for token-id prompts unless echo needs their text


def _scored_only(output: RequestOutput) -> RequestOutput:
    """A max_tokens=0 request runs one engine step for its prompt's scores; the token it samples is
    dropped here, so the answer holds the echoed prompt and nothing generated."""
    emptied = [
        CompletionOutput(c.index, logprobs=[] if c.logprobs is not None else None, finish_reason="length")
        for c in output.outputs
    ]
    return dataclasses.replace(output, outputs=emptied, finished=True)


def _usage(finals: list[RequestOutput]) -> dict:
    return usage(
        sum(len(f.prompt_token_ids) for f in finals),
        sum(len(c.token_ids) for f in finals for c in f.outputs),
        sum(f.num_cached_tokens for f in finals),
    )


class CompletionServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _prepare(self, request: CompletionRequest) -> list[_Prompt]:
        engine = self.state.engine
        prompts = []
        for index, prompt in enumerate(request.prompts()):
            text, token_ids = render_input(
                engine.tokenizer, prompt, index, "prompt", request.add_special_tokens
            )
            if text is None and request.echo and engine.tokenizer is not None:
                text = engine.tokenizer.decode(token_ids)
            prompts.append(_Prompt(token_ids, text))
        return prompts

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        start = time.monotonic()
        state = self.state
        model = state.check_model(request.model)
        state.check_generates()
        state.check_accepting()
        engine = state.engine
        prompts = await state.off_loop(self._prepare, request)
        base_id = f"cmpl-{uuid.uuid4().hex}"
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        # Check every prompt before submitting any, so a bad one leaves nothing half-submitted.
        all_params = []
        if request.constraint is not None:
            await check_constraint(state, request, request.sampling_params(1, None))
        for prompt in prompts:
            max_tokens = resolve_max_tokens(
                len(prompt.token_ids), request.max_tokens or None, engine.max_model_len, "prompt",
                state.default_sampling.get("max_tokens"),  # type: ignore[arg-type]
            )  # fmt: skip
            if request.max_tokens == 0:
                max_tokens = 1  # one step computes the prompt's scores; its token is dropped
            # The engine scores the prompt for the echo's logprobs and for prompt_logprobs: the most of both.
            echoed = request.logprobs if request.echo else None
            wanted = [k for k in (echoed, request.prompt_logprobs) if k is not None]
            params = request.sampling_params(
                max_tokens, request.logprobs, max(wanted, default=None), state.default_sampling
            )
            engine.input_processor.check(prompt.token_ids, params, request.priority)
            all_params.append(params)
        for request_id, prompt, params in zip(request_ids, prompts, all_params):
            state.log_request(request_id, prompt.text, prompt.token_ids, params)
        remote_decode = remote_decode_wanted(request.kv_transfer_params)
        if remote_decode and (
            state.kv_address is None or len(prompts) != 1 or request.n != 1 or request.stream
        ):
            raise bad_request(
                "kv_transfer_params do_remote_decode needs a server started with --kv-role prefill, one "
                "prompt, n=1 and no streaming",
                param="kv_transfer_params",
            )
        state.metrics.record_intake(time.monotonic() - start)
        remotes = [
            await state.remote_prefill(p.token_ids, params, request.n, request.cache_salt)
            for p, params in zip(prompts, all_params)
        ]
        streams: dict[str, AsyncIterator[RequestOutput]] = {}
        try:
            for request_id, prompt, params, remote in zip(
                request_ids, prompts, all_params, remotes, strict=True
            ):
                streams[request_id] = engine.add_request(
                    request_id, prompt.token_ids, params, prompt.text, remote_decode, remote,
                    cache_salt=request.cache_salt, priority=request.priority,
                )  # fmt: skip
        except Exception:
            for request_id in streams:
                engine.abort(request_id)
            raise
        head = {"id": base_id, "created": int(time.time()), "model": model}
        if request.stream:
            return StreamingResponse(
                self._stream(head, request, prompts, streams, raw_request), media_type="text/event-stream"
            )
        finals = await final_outputs(engine, streams, raw_request)
        if request.max_tokens == 0:
            finals = [_scored_only(f) for f in finals]
        choices = []
        for prompt_index, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            for c in final.outputs:
                prefix = prompt.text if request.echo and prompt.text else ""
                choice = self._choice(
                    request, prompt_index, c, prefix + c.text, c.token_ids, c.logprobs, True, len(prefix)
                )
                if request.echo and request.logprobs is not None:
                    choice["logprobs"] = join_logprobs(
                        self._echoed(prompt, final, request.logprobs), choice["logprobs"]
                    )
                if request.prompt_logprobs is not None and final.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(
                        final.prompt_logprobs, request.prompt_logprobs
                    )
                choices.append(choice)
        body = {**head, "object": "text_completion", "choices": choices, "usage": _usage(finals)}
        if remote_decode:  # where the decode peer fetches the prompt's KV, and the token it starts from
            body["kv_transfer_params"] = {
                "kv_address": state.kv_address, "transfer_id": request_ids[0],
                "first_token_id": finals[0].outputs[0].token_ids[0],
            }  # fmt: skip
        return JSONResponse(body)

    def _echoed(self, prompt: _Prompt, output: RequestOutput, k: int) -> dict:
        tokenizer = self.state.engine.tokenizer
        first = prompt.token_ids[0]
        first_text = tokenizer.decode([first]) if tokenizer is not None else f"token_id:{first}"
        scored = [None if entry is None else top_of(entry, k) for entry in output.prompt_logprobs or []]
        return echo_logprobs(scored, first_text)

    def _choice(
        self,
        request: CompletionRequest,
        prompt_index: int,
        completion: CompletionOutput,
        text: str,
        token_ids: list[int],
        logprobs: list | None,
        finished: bool,
        text_offset: int = 0,
    ) -> dict:
        if finished:
            logprobs = reported_logprobs(completion, token_ids, logprobs, self.state.eos_token_ids)
        choice = {
            "index": prompt_index * request.n + completion.index,
            "text": text,
            "logprobs": completion_logprobs(logprobs, text_offset) if logprobs is not None else None,
            "finish_reason": completion.finish_reason if finished else None,
        }
        if finished:
            choice["stop_reason"] = completion.stop_reason
        return choice

    async def _stream(
        self,
        head: dict,
        request: CompletionRequest,
        prompts: list[_Prompt],
        streams: dict[str, AsyncIterator[RequestOutput]],
        raw_request: Request,
    ) -> AsyncIterator[str]:
        engine = self.state.engine
        watcher = DisconnectWatcher(raw_request, lambda: [engine.abort(request_id) for request_id in streams])

        def chunk(
            choices: list[dict], prompt_tokens: int = 0, completion_tokens: int = 0, **extra: object
        ) -> str:
            # With include_usage every chunk carries "usage": null until the last, as OpenAI sends it;
            # with vLLM's continuous_usage_stats, its choice's counts so far.
            running = usage(prompt_tokens, completion_tokens, None) if request.continuous_usage else None
            head_usage = {"usage": running} if request.include_usage else {}
            return sse({**head, "object": "text_completion", "choices": choices, **head_usage, **extra})

        finals: dict[int, RequestOutput] = {}
        # Characters already streamed per choice, so logprobs' text_offset continues across chunks.
        offsets = {
            (p, i): len(prompt.text) if request.echo and prompt.text else 0
            for p, prompt in enumerate(prompts)
            for i in range(request.n)
        }
        # With logprobs, the prompt's scores come with the first output, so the echo waits for it.
        echo_with_logprobs = request.echo and request.logprobs is not None
        echo_pending = {key for key in offsets} if echo_with_logprobs else set()
        try:
            if request.echo and not echo_with_logprobs:
                yield chunk(
                    [
                        {
                            "index": p * request.n + i,
                            "text": prompt.text or "",
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for p, prompt in enumerate(prompts)
                        for i in range(request.n)
                    ],
                    sum(len(prompt.token_ids) for prompt in prompts),
                )
            done: set[tuple[int, int]] = set()
            async for prompt_index, output in merge_streams(list(streams.values())):
                if request.max_tokens == 0:
                    output = _scored_only(output)
                if output.finished:
                    finals[prompt_index] = output
                for c in output.outputs:
                    key = (prompt_index, c.index)
                    if key in done or (not c.delta_text and not c.delta_logprobs and not c.finished()):
                        continue
                    choice = self._choice(
                        request,
                        prompt_index,
                        c,
                        c.delta_text,
                        c.delta_token_ids,
                        c.delta_logprobs,
                        c.finished(),
                        offsets[key],
                    )
                    if key in echo_pending and output.prompt_logprobs is not None:
                        echo_pending.discard(key)
                        prompt = prompts[prompt_index]
                        choice["text"] = (prompt.text or "") + choice["text"]
                        echoed = self._echoed(prompt, output, request.logprobs)
                        choice["logprobs"] = join_logprobs(echoed, choice["logprobs"])
                    yield chunk([choice], len(prompts[prompt_index].token_ids), len(c.token_ids))
                    offsets[key] += len(c.delta_text)
                    if c.finished():
                        done.add(key)
            if len(finals) < len(prompts):
                if not watcher.disconnected:
                    yield error_event(aborted_error())
            elif request.include_usage:
                yield chunk([], usage=_usage([finals[p] for p in range(len(prompts))]))
        except Exception as exc:
            yield error_event(to_openai_error(exc))
        finally:
            watcher.stop()
            for request_id in streams:
                engine.abort(request_id)
        yield SSE_DONE
