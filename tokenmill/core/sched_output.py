"""The per-step records the scheduler hands the worker: plain data only (ids, token ids, block ids,
counts, sampling params), so the worker keeps its own per-request state and may live in another
process. Every record encodes with msgspec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.request import Request


@dataclass
class NewRequestData:
    """A request the worker has not seen: everything it needs to run it from now on."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # a prefix-cache hit: these tokens' KV is already in block_ids
    # Tokens already generated (a prefill peer's first token, with the prompt's KV received).
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class CachedRequestData:
    """What changed for requests the worker already holds, one entry per request."""

    req_ids: list[str] = field(default_factory=list)
    # A resumed request was preempted earlier: its block_ids replace the old ones instead of extending them.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # Tokens each request computes this step, in the order of the batch's rows.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Speculative decoding: the draft tokens a request's step verifies, after its one known input token
    # (they count in num_scheduled_tokens).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Speculation is on at this step's batch: the worker proposes drafts for the next step once this
    # step's tokens are known (off, it skips the work).
    propose_drafts: bool = False
    # Structured outputs: the requests of this step that sample under a grammar. Their masks follow
    # the launch (Scheduler.grammar_fill: int32 words of a bit per vocabulary entry, a row per
    # request): the worker samples them once they come.
    grammar_req_ids: list[str] = field(default_factory=list)
    # The CPU tier of the prefix cache (core/offload.py), before the forward pass and in this order:
    # device blocks copied out to host blocks (evicted, about to be reused), then host blocks copied
    # into device blocks (a prefix hit continued on the host).
    kv_saves: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Its disk tier, around those: host blocks written to disk slots first (before anything overwrites
    # them), and disk slots read into host blocks after the saves, before the loads.
    kv_spills: list[tuple[int, int]] = field(default_factory=list)  # (host block, disk slot)
    kv_disk_reads: list[tuple[int, int]] = field(default_factory=list)  # (disk slot, host block)
    # Prefill/decode disaggregation: KV a prefill peer computed (rows of BlockRows' layout) for blocks.
    kv_recvs: list[tuple[list[int], bytes]] = field(default_factory=list)
    # Requests preempted (state kept, rows dropped) or finished (state dropped) since the last executed step.
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


def new_request_data(request: Request) -> NewRequestData:
    return NewRequestData(
        req_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=list(request.output_token_ids),
        sampling_params=request.sampling_params,
        eos_token_ids=sorted(request.eos_token_ids),
        block_ids=list(request.block_ids),
        num_computed_tokens=request.num_computed_tokens,
    )


def cached_request_data(
    requests: dict[str, Request],
    num_scheduled: dict[str, int],
    new_block_ids: dict[str, list[int]],
    resumed: set[str],
    new_ids: set[str],
) -> CachedRequestData:
    """The step's news for the requests the worker holds (those in new_ids go whole, as NewRequestData)."""
    data = CachedRequestData()
    for request_id in num_scheduled:
        if request_id in new_ids:
            continue
        data.req_ids.append(request_id)
        data.resumed_from_preemption.append(request_id in resumed)
        data.new_block_ids.append(list(new_block_ids[request_id]))
        data.num_computed_tokens.append(requests[request_id].num_computed_tokens)
    return data
