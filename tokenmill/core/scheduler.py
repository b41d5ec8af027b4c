"""The scheduler: each step, how many tokens each request computes, under a token budget and a cap on
running requests. No prefill or decode phases: a prompt chunk, a prefix hit and a decode step are all
"compute the next k tokens of this request". Out of KV blocks, it preempts the newest request, which
later recomputes. A step's plan goes to the worker as plain records (sched_output.py); the next step
can be planned before this one returns, with placeholders for the tokens it will sample. Taking in a
step's results is the other half (step_intake.py, a mixin of Scheduler)."""

from __future__ import annotations

import heapq
import itertools

from tokenmill.core.chunking import chunk_within
from tokenmill.core.kv_cache import KVCacheManager, PrefixHit, cdiv
from tokenmill.core.kv_transfer import KVTransfers
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.sched_output import SchedulerOutput, cached_request_data, new_request_data
from tokenmill.core.spec_scheduling import SpecScheduling
from tokenmill.core.step_intake import StepIntake
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.policy import BatchLimit
from tokenmill.structured_outputs import StructuredOutputs


class Scheduler(StepIntake):
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        context_cost: float = 0.0,
        max_prefill_tokens_with_decodes: int | None = None,
        speculation: SpeculativeConfig | None = None,
        spec_policy: BatchLimit | None = None,
        structured: StructuredOutputs | None = None,
    ) -> None:
        """context_cost: what attending to one earlier token costs a prompt token, as a fraction of the
        token's own cost (the model's matmuls); 0 counts every token as 1 (on a GPU, where a step's time
        is not its arithmetic). max_prefill_tokens_with_decodes: the share of a step prompt chunks may
        take while requests are decoding (None: the whole budget), which bounds the inter-token gap a
        wave of new prompts inflicts on running streams. speculation, spec_policy: the speculative
        decoding config and its batch policy (core/spec_scheduling.py keeps them, as self.spec).
        structured: grammar compilation and masks for requests with structured_outputs (None: the
        engine has no tokenizer, and such requests are refused)."""
        self.kv = kv_cache_manager
        # Prefill/decode disaggregation: blocks held for a decode peer, requests waiting for their KV.
        self.transfers = KVTransfers(kv_cache_manager)
        # Outputs that no step produced (a remotely prefilled request whose first token ends it).
        self.pending_outputs: list[EngineCoreOutput] = []
        self.context_cost = context_cost
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
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
        self.spec = SpecScheduling(speculation, spec_policy, max_model_len)
        self.structured = structured
        self.grammar_mask_seconds = 0.0  # host time filling masks, and the steps that needed them
        self.grammar_mask_steps = 0

    # ---- queue management -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the engine.")
        constraint = request.sampling_params.structured_outputs
        if constraint is not None:
            if self.structured is None:
                raise ValueError(
                    "structured_outputs needs the model's tokenizer: the engine was started without one "
                    "(skip_tokenizer_init)."
                )
            request.grammar, request.grammar_family = self.structured.matcher(constraint)
        self.requests[request.request_id] = request
        if request.remote_prefill is not None:
            self.transfers.add(request)  # it waits for its KV, not for a turn at computing its prompt
            return
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
        """Requests not running yet: queued, or (disaggregation) waiting for their KV from a prefill peer,
        so that a router reading the gauge sees them as load."""
        return sum(1 for entry in self._waiting if not entry[3].status.finished) + len(
            self.transfers.awaiting
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_runnable_requests(self) -> bool:
        """Work a step could do now (not only requests waiting for KV from a prefill peer)."""
        transfers = self.transfers
        return bool(self.running or self._peek_waiting() or transfers.arrived or self.pending_outputs) or (
            any(not r.block_ids for r in transfers.awaiting.values())
        )

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

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
        elif request.remote_prefill is not None:
            self.transfers.forget(request.request_id)
        request.status = status
        if request.remote_decode and status != RequestStatus.FINISHED_ABORTED:
            self.transfers.hold(request)  # its blocks wait for the decode peer to fetch them
        else:
            self.kv.free(request)
        del self.requests[request.request_id]
        if request.grammar is not None and self.structured is not None:
            self.structured.release(request.grammar_family)
        self._finished_since_last_step.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._preempted_since_last_step.append(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(request)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.transfers.reserve()
        budget = self.max_num_batched_tokens
        num_preempted = 0
        num_scheduled: dict[str, int] = {}
        cost_of: dict[str, int] = {}  # each scheduled request's share of the budget
        new_block_ids: dict[str, list[int]] = {}
        spec_decode: dict[str, list[int]] = {}  # the drafts each scheduled decode verifies
        speculating, proposing = self.spec.decide(self.running)

        # While a request waits for a seat, running prompt chunks share at most half of the step, so a
        # long prompt cannot hold every other request back for all of its chunks; what the newcomers
        # leave unused goes back to the cut chunks at the end.
        chunk_room = budget // 2 if self._can_admit() else None
        cut: list[Request] = []
        # Prompt tokens a step may carry beside decodes (prefills alone, as at start-up or for
        # embeddings, take the whole budget).
        prefill_room = budget
        if self.max_prefill_tokens_with_decodes is not None and any(
            r.num_tokens_with_placeholders - r.num_computed_tokens == 1 for r in self.running
        ):
            prefill_room = self.max_prefill_tokens_with_decodes

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_wanted = request.num_tokens_with_placeholders - request.num_computed_tokens
            room = budget
            if num_wanted > 1:  # a prompt chunk: within the prefill cap and the half-step room
                room = min(budget, prefill_room, budget if chunk_room is None else chunk_room)
            drafts = self.spec.drafts(request, num_wanted, budget) if speculating else []
            if drafts:  # a decode verifying drafts: one token and the drafts, at decode cost
                num_new = cost = 1 + len(drafts)
            else:
                num_new, cost = chunk_within(
                    self.context_cost, request.num_computed_tokens, num_wanted, room, fresh=not num_scheduled
                )
            if num_wanted > 1 and num_new < num_wanted:
                cut.append(request)
            if chunk_room is not None and num_wanted > 1:
                chunk_room -= cost
            if num_new <= 0 or self._reaches_limit_in_flight(request):
                index += 1
                continue
            while (
                allocated := self.kv.allocate_slots(request, self.spec.with_lookahead(request, num_new))
            ) is None:
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                position = self.running.index(victim)
                if num_scheduled.pop(victim.request_id, None) is not None:
                    new_block_ids.pop(victim.request_id)
                    spec_decode.pop(victim.request_id, None)
                    freed = cost_of.pop(victim.request_id)
                    budget += freed
                    if victim.num_tokens_with_placeholders - victim.num_computed_tokens > 1:
                        prefill_room += freed
                self._preempt(victim)
                if position < index:  # the list shifts under the cursor, scheduled or passed over
                    index -= 1
                num_preempted += 1
                if victim is request:
                    break
            else:
                num_scheduled[request.request_id] = num_new
                cost_of[request.request_id] = cost
                new_block_ids[request.request_id] = allocated
                if drafts:
                    spec_decode[request.request_id] = drafts
                budget -= cost
                if num_wanted > 1:
                    prefill_room -= cost
                index += 1

        new_requests: list[Request] = []
        resumed: set[str] = set()
        kv_recvs = self._join_remote_prefills(
            min(budget, self.max_num_seqs - len(self.running)), new_requests
        )
        for request in new_requests:
            num_scheduled[request.request_id] = cost_of[request.request_id] = 1
            new_block_ids[request.request_id] = request.block_ids
            budget -= 1
        # New requests only when nobody had to be preempted: otherwise they would just thrash.
        while not num_preempted and min(budget, prefill_room) > 0 and len(self.running) < self.max_num_seqs:
            candidate = self._peek_waiting()
            # A preempted request whose last step is still in flight waits for that step's token.
            if candidate is None or candidate.num_output_placeholders:
                break
            request = candidate
            hit = PrefixHit([], 0, [])
            # Prompt logprobs need every prompt position computed, so such requests skip the cache.
            if request.sampling_params.prompt_logprobs is None:
                hit = self.kv.get_computed_blocks(request)
            num_hit_tokens = hit.num_tokens
            num_new, cost = chunk_within(
                self.context_cost,
                num_hit_tokens,
                request.num_tokens - num_hit_tokens,
                min(budget, prefill_room),
                fresh=not num_scheduled,
            )
            if num_new <= 0 or (
                self.kv.allocate_slots(
                    request,
                    self.spec.with_lookahead(request, num_new, num_hit_tokens),
                    hit.block_ids,
                    hit.host_block_ids,
                )  # fmt: skip
                is None
            ):
                break
            heapq.heappop(self._waiting)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if request.status == RequestStatus.PREEMPTED:
                resumed.add(request.request_id)
            else:
                new_requests.append(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            cost_of[request.request_id] = cost
            new_block_ids[request.request_id] = request.block_ids
            budget -= cost
            prefill_room -= cost

        for request in cut:
            room = min(budget, prefill_room)
            if room <= 0 or request.status != RequestStatus.RUNNING:
                continue
            num_new, cost = num_scheduled.get(request.request_id, 0), cost_of.get(request.request_id, 0)
            num_wanted = request.num_tokens_with_placeholders - request.num_computed_tokens
            longer, longer_cost = chunk_within(
                self.context_cost, request.num_computed_tokens, num_wanted, room + cost
            )
            if longer <= num_new:
                continue
            allocated = self.kv.allocate_slots(request, self.spec.with_lookahead(request, longer))
            if allocated is None:
                continue
            num_scheduled[request.request_id], cost_of[request.request_id] = longer, longer_cost
            new_block_ids.setdefault(request.request_id, []).extend(allocated)
            budget -= longer_cost - cost
            prefill_room -= longer_cost - cost

        if not num_scheduled:
            # An empty step is never executed: its news for the worker waits for the next real one.
            return SchedulerOutput()
        out = SchedulerOutput(
            scheduled_new_reqs=[new_request_data(r) for r in new_requests],
            scheduled_cached_reqs=cached_request_data(
                self.requests, num_scheduled, new_block_ids, resumed, {r.request_id for r in new_requests}
            ),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            scheduled_spec_decode_tokens=spec_decode,
            propose_drafts=proposing,
            **self._grammar_requests(num_scheduled),
            preempted_req_ids=self._preempted_since_last_step,
            finished_req_ids=self._finished_since_last_step,
        )
        if self.kv.host is not None:
            out.kv_saves, out.kv_loads = self.kv.host.drain()
            out.kv_spills, out.kv_disk_reads = self.kv.host.drain_disk()
        out.kv_recvs = kv_recvs
        self._preempted_since_last_step, self._finished_since_last_step = [], []
        for request_id, num_new in num_scheduled.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_new
            request.spec_token_ids = []  # consumed (or stale): the worker proposes again after the step
            num_drafts = len(spec_decode.get(request_id, ()))
            if request.num_computed_tokens - num_drafts == request.num_tokens_with_placeholders:
                request.num_output_placeholders += 1  # this step samples the request's next token
        return out

    def _join_remote_prefills(self, room: int, joined: list[Request]) -> list[tuple[list[int], bytes]]:
        """Requests whose KV a prefill peer sent: they run from their first output token on. Returns the
        copies into their blocks the step makes ahead of its forward pass."""
        recvs = []
        for request, data in self.transfers.ready(room):
            num_prompt_blocks = cdiv(request.num_prompt_tokens, self.kv.block_size)
            recvs.append((request.block_ids[:num_prompt_blocks], data))
            request.num_computed_tokens = request.num_prompt_tokens
            request.num_cached_tokens = 0
            assert request.remote_prefill is not None
            first_token_id = request.remote_prefill.first_token_id
            request.append_output_token(first_token_id)
            request.unreported_token_ids = [first_token_id]
            status = self._check_stop(request)
            if status is not None:  # the peer's token ends it: nothing to run
                self.pending_outputs.append(
                    EngineCoreOutput(request.request_id, request.unreported_token_ids,
                                     finish_reason=status.finish_reason, stop_reason=request.stop_reason)
                )  # fmt: skip
                recvs.pop()
                self._finish(request, status)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            joined.append(request)
        return recvs

    def _grammar_requests(self, num_scheduled: dict[str, int]) -> dict:
        """The step's requests that sample under a grammar (before the step's counts move)."""
        if self.structured is None or not any(r.grammar is not None for r in self.running):
            return {}
        requests = self.requests
        sampling: list[str] = []
        for request_id, num_new in num_scheduled.items():
            request = requests[request_id]
            if request.grammar is not None and (
                request.num_computed_tokens + num_new >= request.num_tokens_with_placeholders
            ):
                sampling.append(request_id)
        return {"grammar_req_ids": sampling} if sampling else {}

    def _can_admit(self) -> bool:
        """True when a waiting request could take a seat this step (blocks permitting)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        candidate = self._peek_waiting()
        return candidate is not None and not candidate.num_output_placeholders

    def _reaches_limit_in_flight(self, request: Request) -> bool:
        """True when the tokens already being sampled take the request to max_tokens or max_model_len,
        so another step for it would only be thrown away."""
        if not request.num_output_placeholders:
            return False
        max_tokens = request.sampling_params.max_tokens
        return request.num_tokens_with_placeholders >= self.max_model_len or (
            max_tokens is not None
            and request.num_output_tokens + request.num_output_placeholders >= max_tokens
        )
