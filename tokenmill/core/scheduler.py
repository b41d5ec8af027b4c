"""The scheduler: each step, how many tokens each request computes, under a token budget and a cap on
running requests. No prefill or decode phases: a prompt chunk, a prefix hit and a decode step are all
"compute the next k tokens of this request". Out of KV blocks, it preempts the newest request, which
later recomputes."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    total_num_scheduled_tokens: int = 0
    # Requests preempted or finished since the previous executed step, so the worker can drop their state.
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.kv = kv_cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # Heap of (priority, arrival_time, tiebreak, request); aborted entries are skipped lazily.
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()
        self._finished_since_last_step: list[str] = []
        self._preempted_since_last_step: list[str] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine.")
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def _push_waiting(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._tiebreak), request)
        heapq.heappush(self._waiting, key)

    def _peek_waiting(self) -> Request | None:
        while self._waiting and self._waiting[0][3].status.finished:
            heapq.heappop(self._waiting)
        return self._waiting[0][3] if self._waiting else None

    @property
    def num_waiting(self) -> int:
        return sum(1 for entry in self._waiting if not entry[3].status.finished)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._preempted_since_last_step.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_preempted = 0
        scheduled: dict[str, ScheduledRequest] = {}

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                    index -= 1
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled[request.request_id] = ScheduledRequest(request, num_new)
                budget -= num_new
                index += 1

        # New requests only when nobody had to be preempted: otherwise they would just thrash.
        while not num_preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            waiting = self._peek_waiting()
            if waiting is None:
                break
            request = waiting
            computed_blocks: list[int] = []
            num_hit_tokens = 0
            # Prompt logprobs need every prompt position computed, so such requests skip the cache.
            if request.num_computed_tokens == 0 and request.sampling_params.prompt_logprobs is None:
                computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, computed_blocks):
                break
            heapq.heappop(self._waiting)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = ScheduledRequest(request, num_new)
            budget -= num_new

        if not scheduled:
            # An empty step is never executed: its news for the worker waits for the next real one.
            return SchedulerOutput()
        out = SchedulerOutput(
            scheduled=list(scheduled.values()),
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_req_ids=self._preempted_since_last_step,
            finished_req_ids=self._finished_since_last_step,
        )
        self._preempted_since_last_step, self._finished_since_last_step = [], []
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        for i, (request, num_new) in enumerate(scheduler_output.scheduled):
            if request.status.finished:  # aborted while the step ran
                continue
            if runner_output.prompt_logprobs and request.request_id in runner_output.prompt_logprobs:
                self._add_prompt_logprobs(request, *runner_output.prompt_logprobs[request.request_id])
            request.num_computed_tokens += num_new
            self.kv.cache_full_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prompt chunk: its sampled token is meaningless
            token_id = runner_output.sampled_token_ids[i]
            request.append_output_token(token_id)
            status = self._check_stop(request)
            logprobs = runner_output.logprobs[i] if runner_output.logprobs else None
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[token_id],
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finish_reason=status.finish_reason if status is not None else None,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens,
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
        return outputs

    @staticmethod
    def _add_prompt_logprobs(request: Request, first_position: int, entries: list) -> None:
        # A recomputed (preempted) prompt scores positions again: keep only the ones not yet seen.
        skip = len(request.prompt_logprobs) + 1 - first_position
        if 0 <= skip < len(entries):
            request.prompt_logprobs.extend(entries[skip:])

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        max_tokens = params.max_tokens
        if request.num_tokens >= self.max_model_len or (
            max_tokens is not None and request.num_output_tokens >= max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        return None
