"""A request as the engine core sees it: token ids, how many are computed, its KV blocks, its status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from tokenmill.core.outputs import TokenLogprobs
from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.core.kv_transfer import RemotePrefill


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # Advanced when a step is scheduled, not when it finishes: with async scheduling the next step is
        # planned while this one runs. Tokens such a step will sample are placeholders until it returns.
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []  # drafts for the next step (speculative decoding)
        self.spec_acceptance = 1.0  # running average of its drafts' acceptance (optimistic at first)
        self.spec_steps_off = 0  # decode steps it skipped drafts for low acceptance
        # Structured outputs: the llguidance matcher of its constraint, advanced with every output token,
        # and which of the constraint's compiled copies it came from (structured_outputs.py). Its tokens
        # reach the matcher on the helper thread that fills the next step's masks (Scheduler.grammar_fill):
        # until then they wait here. A token still on its way from the device when that fill was planned
        # goes to the matcher straight from the step's output instead ("claimed": not kept here).
        self.grammar = None
        self.grammar_family = -1
        self.grammar_unconsumed: list[int] = []
        self.grammar_claimed = 0
        self.block_ids: list[int] = []
        # Chained hashes of this request's full blocks, and how many of them are in the prefix cache.
        self.block_hashes: list[int] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until scheduled
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.prompt_logprobs: list[TokenLogprobs] = []  # prompt tokens 1.. scored so far
        # Prefill/decode disaggregation (core/kv_transfer.py): on a prefill instance, keep the blocks for
        # a decode peer when finished; on a decode instance, the prefill peer's work to take over, and
        # the first token it sampled until it has been sent.
        self.remote_decode = False
        self.remote_prefill: RemotePrefill | None = None
        self.unreported_token_ids: list[int] = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)}, {self.status.name})"
        )
