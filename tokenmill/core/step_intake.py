"""Taking in a step's results: each request's sampled tokens appended, stop conditions and grammars
checked, prefix-cache blocks filled in, and the outputs the front end streams; and the grammar masks a
step needs from the grammars as they then stand. The scheduler's other half (scheduler.py plans the
steps); a mixin of Scheduler, whose state it reads and moves."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenmill.core.outputs import GRAMMAR_FAILED, EngineCoreOutput, ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import SchedulerOutput

logger = logging.getLogger("tokenmill")
_NONE_STOPPED: Mapping[str, str | None] = MappingProxyType({})

if TYPE_CHECKING:
    from tokenmill.core.kv_cache import KVCacheManager
    from tokenmill.core.spec_scheduling import SpecScheduling
    from tokenmill.structured_outputs import StructuredOutputs


class GrammarFill:
    """A step's mask fill for the helper thread (StepIntake.grammar_fill): call it with the function that
    publishes the masks to whoever waits for them, and one it calls once the grammars have their tokens.
    It fills, publishes, and then (off the masks' path) asks the matchers which are stopped. Returns
    (masks, {request id: None where its grammar is complete, llguidance's error where it failed}), the
    second for update_from_output."""

    def __init__(
        self,
        intake: StepIntake,
        req_ids: list[str],
        matchers: list,
        families: list[int],
        into: np.ndarray | None,
        consume: list[tuple[Any, int]],
        claimed: list[tuple[Any, int]],
        tokens: Callable[[], list[int]] | None,
    ) -> None:
        assert intake.structured is not None
        self.intake, self.req_ids, self.matchers = intake, req_ids, matchers
        self.tokens = tokens  # the step in flight's tokens, for the `claimed` (matcher, row) pairs
        self.waited = 0.0  # seconds the fill waited for them: left out of the mask time reported
        self.fill_mask = intake.structured.bitmask_fill(  # its Python half, here
            matchers, families, into, consume, (self._wait_for_tokens, claimed) if claimed else None
        )

    def _wait_for_tokens(self) -> list[int]:
        assert self.tokens is not None
        start = time.perf_counter()
        tokens = self.tokens()
        self.waited = time.perf_counter() - start
        return tokens

    def __call__(
        self, publish: Callable[[], None] = lambda: None, consumed: Callable[[], None] = lambda: None
    ) -> tuple[np.ndarray, dict[str, str | None]]:
        start = time.perf_counter()
        mask = self.fill_mask(consumed)
        self.intake.grammar_mask_seconds += time.perf_counter() - start - self.waited
        self.intake.grammar_mask_steps += 1
        publish()
        stopped = {
            request_id: matcher.get_error() if matcher.is_error() else None
            for request_id, matcher in zip(self.req_ids, self.matchers)
            if matcher is not None and matcher.is_stopped()
        }
        return mask, stopped


class StepIntake:
    """update_from_output, the stop checks and grammar_fill, over the Scheduler's requests, KV manager,
    speculation state and structured outputs."""

    requests: dict[str, Request]
    kv: KVCacheManager
    spec: SpecScheduling
    max_model_len: int

    structured: StructuredOutputs | None
    grammar_mask_seconds: float
    grammar_mask_steps: int
    _finish: Callable[[Request, RequestStatus], None]

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        grammar_stopped: Mapping[str, str | None] = _NONE_STOPPED,
    ) -> list[EngineCoreOutput]:
        """grammar_stopped: the requests whose grammar the step's fill found complete (None) or failed
        (llguidance's error) once it had the token before this step's (GrammarFill)."""
        outputs = []
        prompt_logprobs = runner_output.prompt_logprobs
        self.spec.begin_update()
        for row, request_id in enumerate(runner_output.req_ids):
            request = self.requests.get(request_id)
            if request is None:  # finished or aborted while the step ran
                continue
            if prompt_logprobs and request_id in prompt_logprobs:
                self._add_prompt_logprobs(request, *prompt_logprobs[request_id])
            new_token_ids = runner_output.sampled_token_ids[row]
            running = request.status == RequestStatus.RUNNING
            if not new_token_ids:  # a prompt chunk: nothing sampled that counts
                if running:
                    self.kv.cache_full_blocks(request)
                continue
            # A preempted request keeps the token: it was sampled from a complete context.
            request.num_output_placeholders -= 1
            pooled = runner_output.pooled[row] if runner_output.pooled else None
            if pooled is not None:  # a pooling request is done with its prompt; its token was a placeholder
                if running:
                    self.kv.cache_full_blocks(request)
                outputs.append(
                    EngineCoreOutput(
                        request_id, [], finish_reason="stop", num_cached_tokens=request.num_cached_tokens,
                        pooled=pooled,
                    )
                )  # fmt: skip
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(request_id)
            if drafts:
                self.spec.accepted(request, len(drafts), len(new_token_ids) - 1)
                if running:  # the KV of the rejected drafts' positions is overwritten from here on
                    request.num_computed_tokens -= len(drafts) + 1 - len(new_token_ids)
            status = None
            appended = 0
            error = None
            if request_id in grammar_stopped:
                # Its grammar completed with the token before this one (consumed since, by this step's
                # fill): that one was its last, and this step's token is dropped. A grammar that failed
                # (llguidance refused a token its own mask let through) ends the request as failed, not
                # as an answer that looks complete.
                status = RequestStatus.FINISHED_STOPPED
                new_token_ids = []
                failure = grammar_stopped[request_id]
                if failure is not None:
                    status = RequestStatus.FINISHED_ABORTED
                    first_line = failure.split("\n", 1)[0]
                    error = f"{GRAMMAR_FAILED} with the answer's first {request.num_output_tokens} tokens"
                    error += f" ({first_line})"
                    logger.warning("request %s: %s", request_id, error)
            for token_id in new_token_ids:  # a stop among accepted drafts ends the request there
                request.append_output_token(token_id)
                appended += 1
                status = self._check_stop(request)
                if request.grammar is not None:
                    # The mask let only this token through; the next step's fill hands it to the grammar
                    # (or already took it from the device).
                    if request.grammar_claimed:
                        request.grammar_claimed -= 1
                    elif status is None:
                        request.grammar_unconsumed.append(token_id)
                if status is not None:
                    break
            if running:
                self.kv.cache_full_blocks(request)
            logprobs = runner_output.logprobs[row] if runner_output.logprobs else None
            reported = new_token_ids[:appended]
            if request.unreported_token_ids:  # a prefill peer's first token, not yet sent
                reported = request.unreported_token_ids + reported
                request.unreported_token_ids = []
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=reported,
                    new_logprobs=logprobs[:appended] if logprobs is not None else None,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    error=error,
                    prompt_logprobs=(
                        request.prompt_logprobs
                        if request.num_output_tokens == 1
                        and request.sampling_params.prompt_logprobs is not None
                        else None
                    ),
                )
            )
            if status is not None:
                self._finish(request, status)
            elif running and runner_output.spec_token_ids:
                request.spec_token_ids = runner_output.spec_token_ids[row]
        self.spec.end_update()
        return outputs

    @staticmethod
    def _add_prompt_logprobs(request: Request, first_position: int, entries: list) -> None:
        # A recomputed (preempted) prompt scores positions again: keep only the ones not yet seen.
        skip = len(request.prompt_logprobs) + 1 - first_position
        if 0 <= skip < len(entries):
            request.prompt_logprobs.extend(entries[skip:])

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        # A stop token that is also the last token allowed is a stop, not a length cut (OpenAI, vLLM).
        if request.num_output_tokens >= params.min_tokens:
            last = request.output_token_ids[-1]
            if not params.ignore_eos and last in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if request.num_tokens >= self.max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH
        return None

    def grammar_fill(
        self,
        out: SchedulerOutput,
        into: np.ndarray | None = None,
        in_flight: tuple[list[str], list[bool], Callable[[], list[int]]] | None = None,
    ) -> GrammarFill:
        """A call that fills the allowed-token rows of a scheduled step's constrained requests
        (grammar_req_ids) from their matchers, for the engine core to run on its helper thread after
        launching the step. The matchers are picked here; a request that finished meanwhile gets a row
        that allows everything (its token is dropped). into: the array to fill (else a new one).
        in_flight: the step before, not yet taken in (PendingRunnerOutput.tokens_in_flight): the tokens
        its rows sample go to their grammars straight from it, so the fill need not wait for the core to
        take them in; the take-in then leaves them out of grammar_unconsumed."""
        assert self.structured is not None  # a request with a grammar was refused without one
        req_ids = out.grammar_req_ids
        requests = [self.requests.get(r) for r in req_ids]
        rows = {}
        if in_flight is not None:
            rows = {request_id: row for row, (request_id, keeps) in enumerate(zip(*in_flight[:2])) if keeps}
        matchers: list[Any] = []
        families: list[int] = []
        consume: list[tuple[Any, int]] = []  # (matcher, token) for each token not yet in its grammar
        claimed: list[tuple[Any, int]] = []  # (matcher, row of the step in flight)
        for request_id, request in zip(req_ids, requests):
            if request is None:
                matchers.append(None)
                families.append(-1)
                continue
            matchers.append(request.grammar)
            families.append(request.grammar_family)
            if request.grammar_unconsumed:
                consume.extend((request.grammar, token_id) for token_id in request.grammar_unconsumed)
                request.grammar_unconsumed = []
            row = rows.get(request_id)
            if row is not None:
                claimed.append((request.grammar, row))
                request.grammar_claimed += 1
        tokens = in_flight[2] if in_flight is not None else None
        return GrammarFill(self, req_ids, matchers, families, into, consume, claimed, tokens)
