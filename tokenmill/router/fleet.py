"""One simulated replica for `router simulate`: the engine's continuous batching (decodes first, then
prompt chunks under a token budget, new requests admitted while seats and KV blocks last), its own true
prefix cache (full blocks, LRU, capacity from the planner), and each step's time from the planner's
roofline for that step's mix of decode and prompt tokens."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterator
from functools import cache
from typing import NamedTuple

from tokenmill.plan.gpus import RooflineCeilings
from tokenmill.plan.memory import Deployment, kv_bytes_per_token
from tokenmill.plan.roofline import (
    attention_flops_per_context_token,
    matmul_flops_per_token,
    weight_bytes_read,
)
from tokenmill.router.trace import Session, TraceRequest


class StepModel:
    """A step's time: its roofline floor (bytes over bandwidth or FLOPs over peak, whichever binds, as
    roofline.decode_point and prefill_point count them) plus a fixed overhead for what the floor leaves
    out (kernel launches, sampling, the host's share of the step)."""

    def __init__(
        self, deployment: Deployment, ceilings: RooflineCeilings, tp: int, overhead_s: float
    ) -> None:
        shape = deployment.shape
        self.overhead_s = overhead_s
        self._bandwidth = ceilings.bandwidth_bytes_s
        self._peak_flops = ceilings.flops
        self._kv_bytes = kv_bytes_per_token(shape, deployment.kv_dtype, tp)
        self._body_flops = matmul_flops_per_token(shape, with_lm_head=False) / tp
        self._head_flops = matmul_flops_per_token(shape) / tp - self._body_flops
        self._decode_attention_flops = attention_flops_per_context_token(shape, "decode") / tp
        self._prefill_attention_flops = attention_flops_per_context_token(shape, "prefill") / tp
        self._weight_bytes = cache(lambda num_tokens: weight_bytes_read(deployment, num_tokens) / tp)

    def floor_s(
        self, num_tokens: int, num_sampled: int, kv_tokens: int, decode_context: int, prefill_pairs: int
    ) -> float:
        """num_tokens computed, num_sampled of them sampled (decodes and finished prompts); kv_tokens of
        KV read or written; decode_context: the decodes' contexts summed; prefill_pairs: the query-key
        pairs of the prompt chunks' causal attention."""
        bytes_moved = self._weight_bytes(num_tokens) + kv_tokens * self._kv_bytes
        flops = (
            self._body_flops * num_tokens
            + self._head_flops * num_sampled
            + self._decode_attention_flops * decode_context
            + self._prefill_attention_flops * prefill_pairs
        )
        return max(bytes_moved / self._bandwidth, flops / self._peak_flops)


class Request:
    """A trace request on its way through the fleet."""

    __slots__ = (
        "request_id", "trace", "session", "turn", "arrival_s", "replica", "num_computed_tokens",
        "num_cached_tokens", "estimated_cached_tokens", "first_token_s", "finish_s",
    )  # fmt: skip

    def __init__(self, request_id: int, session: Session, turn: int, arrival_s: float) -> None:
        self.request_id = request_id
        self.trace: TraceRequest = session.turns[turn]
        self.session = session
        self.turn = turn
        self.arrival_s = arrival_s
        self.replica = ""
        self.num_computed_tokens = 0  # prompt tokens in the KV cache, from the prefix cache or computed
        self.num_cached_tokens = 0  # of those, the ones the replica's prefix cache held
        self.estimated_cached_tokens = 0  # what the router's index thought it held
        self.first_token_s = 0.0
        self.finish_s = 0.0


class StepPlan(NamedTuple):
    start_s: float
    duration_s: float
    num_steps: int  # more than one only for a run of decode-only steps (nothing changes in between)
    num_decodes: int
    chunks: list[tuple[Request, int]]  # prompt chunks: request, tokens computed this step


class Replica:
    def __init__(
        self,
        name: str,
        capacity_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        step_model: StepModel,
    ) -> None:
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_model = step_model
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not all computed yet, in admission order
        self._decoding: list[tuple[int, int, Request]] = []  # heap: (decode step it ends at, id, request)
        self.decode_context = 0  # the decoding requests' contexts summed
        self.num_decode_steps = 0
        self.in_flight: StepPlan | None = None
        self.version = 0  # bumped when the step in flight is cut short: its old end is stale
        # The true prefix cache: blocks held by running requests, and freed blocks kept for reuse.
        self.in_use: dict[int, int] = {}  # block hash -> running requests holding it
        self.free_lru: OrderedDict[int, None] = OrderedDict()  # oldest first: evicted first
        self.num_private_blocks = 0  # running requests' partial last blocks (never shared)
        self.busy_s = 0.0
        self.num_requests = 0
        self.num_output_tokens = 0
        self.num_prefill_tokens = 0

    @property
    def load(self) -> int:
        """Requests in hand: what the router counts (sent, not yet answered)."""
        return len(self.waiting) + len(self.prefilling) + len(self._decoding)

    @property
    def num_blocks_held(self) -> int:
        return len(self.in_use) + len(self.free_lru) + self.num_private_blocks

    def plan_step(self, now: float) -> StepPlan | None:
        """The next step: every decode, then prompt chunks of admitted requests, then new admissions,
        while the token budget lasts. None when there is nothing to run. Decodes alone run on as one
        plan until the first of them finishes: until then nothing can change but an arrival, which
        cuts the run short (cut_short)."""
        num_decodes = len(self._decoding)
        budget = self.max_num_batched_tokens - num_decodes
        chunks = []
        for request in self.prefilling:
            if budget == 0:
                break
            chunk = min(request.trace.prompt_len - request.num_computed_tokens, budget)
            chunks.append((request, chunk))
            budget -= chunk
        while budget > 0 and self.waiting and self.load - len(self.waiting) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._admit(request):
                break  # first come, first served: a request that does not fit yet holds the queue
            self.waiting.popleft()
            self.prefilling.append(request)
            chunk = min(request.trace.prompt_len - request.num_computed_tokens, budget)
            chunks.append((request, chunk))
            budget -= chunk
        if not chunks:
            if not num_decodes:
                return None
            num_steps = self._decoding[0][0] - self.num_decode_steps
            duration_s = sum(self._decode_steps_s(num_steps))
            self.in_flight = StepPlan(now, duration_s, num_steps, num_decodes, chunks)
            self.busy_s += duration_s
            return self.in_flight
        num_tokens, num_sampled, kv_tokens, prefill_pairs = num_decodes, num_decodes, self.decode_context, 0
        for request, chunk in chunks:
            start = request.num_computed_tokens
            num_tokens += chunk
            kv_tokens += start + chunk
            prefill_pairs += chunk * start + chunk * (chunk + 1) // 2
            num_sampled += start + chunk == request.trace.prompt_len
        floor_s = self.step_model.floor_s(
            num_tokens, num_sampled, kv_tokens, self.decode_context, prefill_pairs
        )
        self.in_flight = StepPlan(now, floor_s + self.step_model.overhead_s, 1, num_decodes, chunks)
        self.busy_s += self.in_flight.duration_s
        return self.in_flight

    def cut_short(self, now: float) -> StepPlan | None:
        """A request arrived: end the run of decode steps in flight at the first step boundary from
        `now`, so the next step can admit it. The shortened plan, or None if the end is unchanged."""
        step = self.in_flight
        if step is None or step.num_steps == 1:
            return None
        duration_s, num_steps = 0.0, 0
        for step_s in self._decode_steps_s(step.num_steps):
            duration_s += step_s
            num_steps += 1
            if step.start_s + duration_s >= now:
                break
        if num_steps == step.num_steps:
            return None
        self.busy_s -= step.duration_s - duration_s
        self.in_flight = step._replace(duration_s=duration_s, num_steps=num_steps)
        self.version += 1
        return self.in_flight

    def _decode_steps_s(self, num_steps: int) -> Iterator[float]:
        """The times of the next num_steps decode-only steps: each context grows by one token a step."""
        num_decodes, context = len(self._decoding), self.decode_context
        for _ in range(num_steps):
            yield (
                self.step_model.floor_s(num_decodes, num_decodes, context, context, 0)
                + self.step_model.overhead_s
            )
            context += num_decodes

    def finish_step(self, now: float) -> list[Request]:
        """Apply the step in flight, which ended at `now`; the requests it finished."""
        assert self.in_flight is not None
        step, self.in_flight = self.in_flight, None
        finished = []
        if step.num_decodes:
            self.num_output_tokens += step.num_decodes * step.num_steps
            self.num_decode_steps += step.num_steps
            self.decode_context += step.num_decodes * step.num_steps
            while self._decoding and self._decoding[0][0] <= self.num_decode_steps:
                request = heapq.heappop(self._decoding)[2]
                self.decode_context -= request.trace.prompt_len + request.trace.output_len
                finished.append(self._finish(request, now))
        for request, chunk in step.chunks:
            request.num_computed_tokens += chunk
            self.num_prefill_tokens += chunk
            if request.num_computed_tokens < request.trace.prompt_len:
                continue
            request.first_token_s = now  # the step that computes the prompt's last token samples one
            self.num_output_tokens += 1
            if request.trace.output_len == 1:
                finished.append(self._finish(request, now))
                continue
            self.decode_context += request.trace.prompt_len + 1
            finish_at = self.num_decode_steps + request.trace.output_len - 1
            heapq.heappush(self._decoding, (finish_at, request.request_id, request))
        if step.chunks:
            self.prefilling = [r for r in self.prefilling if r.num_computed_tokens < r.trace.prompt_len]
        return finished

    def _admit(self, request: Request) -> bool:
        """Give the request KV blocks for its whole prompt and answer (so nothing is ever preempted),
        reusing the leading prompt blocks the cache holds and evicting least recently used free blocks
        for the rest; False, changing nothing, when even eviction cannot make room."""
        trace = request.trace
        hashes = trace.block_hashes[: trace.num_blocks]
        in_use, free_lru = self.in_use, self.free_lru
        num_prompt_blocks = trace.prompt_len // self.block_size
        num_hit, num_new, reused = 0, 0, []
        for block_hash in hashes:
            if block_hash in free_lru:
                reused.append(block_hash)
            elif block_hash not in in_use:
                num_new += 1
                continue
            if num_hit < num_prompt_blocks and not num_new:
                num_hit += 1  # still in the unbroken run of cached blocks the prompt starts with
        num_private = -(-(trace.prompt_len + trace.output_len) // self.block_size) - trace.num_blocks
        num_evict = self.num_blocks_held + num_new + num_private - self.capacity_blocks
        if num_evict > len(self.free_lru) - len(reused):
            return False
        for block_hash in reused:
            del self.free_lru[block_hash]
        for _ in range(max(num_evict, 0)):
            self.free_lru.popitem(last=False)
        for block_hash in hashes:
            self.in_use[block_hash] = self.in_use.get(block_hash, 0) + 1
        self.num_private_blocks += num_private
        # At least the prompt's last token is computed: its logits give the first output token.
        request.num_cached_tokens = min(num_hit * self.block_size, trace.prompt_len - 1)
        request.num_computed_tokens = request.num_cached_tokens
        self.num_requests += 1
        return True

    def _finish(self, request: Request, now: float) -> Request:
        """Free the request's blocks: full ones stay cached, the tail of the answer first in line for
        eviction (so the longest prefixes survive), as the engine frees them."""
        trace = request.trace
        for block_hash in reversed(trace.block_hashes[: trace.num_blocks]):
            holders = self.in_use[block_hash] - 1
            if holders:
                self.in_use[block_hash] = holders
            else:
                del self.in_use[block_hash]
                self.free_lru[block_hash] = None
        self.num_private_blocks -= (
            -(-(trace.prompt_len + trace.output_len) // self.block_size) - trace.num_blocks
        )
        request.finish_s = now
        return request
