"""The worker's own view of its requests, kept up to date from the scheduler's per-step records, and the
host-side construction of each step's flat varlen inputs over a persistent block table (one row per
running request, updated only where a request gained blocks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from tokenmill.core.sched_output import SchedulerOutput
from tokenmill.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    # Tokens sampled by a step still in flight: on the device, not yet in output_token_ids.
    num_pending_tokens: int = 0
    # (vocab size, the row's sampling knobs and flags), worker/sampling_batch.py's, computed on first use.
    sampling_knobs: tuple | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the ones still in flight included (what min_tokens counts)."""
        return len(self.output_token_ids) + self.num_pending_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


class StepInputs(NamedTuple):
    """One step's inputs as host arrays, ready to be copied to the device."""

    req_ids: list[str]  # one per row
    input_ids: np.ndarray  # [num_tokens] int64; a token still on the device is 0 here, see pending_*
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    max_query_len: int
    num_decodes: int  # requests with one query token this step
    max_seq_len: int
    samples: list[bool]  # per row: does the token sampled this step count (False for a prompt chunk)
    num_drafts: list[int]  # per row: draft tokens verified after the row's one known input token
    # Input tokens sampled by the previous step, still on the device: (flat index here, row there).
    pending_dst: list[int]
    pending_src_req_ids: list[str]


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.requests: dict[str, CachedRequestState] = {}
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks_in_row = np.zeros(max_num_reqs, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    # ---- state from the records -------------------------------------------------------------

    def _release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.num_blocks_in_row[row] = 0
            self.free_rows.append(row)

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_req_ids:
            self.requests.pop(request_id, None)
            self._release(request_id)
        for request_id in scheduler_output.preempted_req_ids:
            self._release(request_id)  # the state stays: the request resumes from its tokens later
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                eos_token_ids=frozenset(new.eos_token_ids),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            for token_id in new.output_token_ids:
                self.requests[new.req_id].append_output_token(token_id)
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            state = self.requests[request_id]
            if cached.resumed_from_preemption[i]:
                self._release(request_id)
                state.block_ids = list(cached.new_block_ids[i])
            else:
                state.block_ids.extend(cached.new_block_ids[i])
            state.num_computed_tokens = cached.num_computed_tokens[i]

    def record_sampled(self, req_ids: list[str], samples: list[bool], token_ids: list[list[int]]) -> None:
        """A step's sampled tokens (one per row, or the accepted drafts and one more after a verified
        step) reached the host: they stop being pending."""
        for request_id, keeps, row_tokens in zip(req_ids, samples, token_ids):
            state = self.requests.get(request_id)
            if keeps and state is not None:  # None: finished while the step ran
                state.num_pending_tokens -= 1
                for token_id in row_tokens:
                    state.append_output_token(token_id)

    # ---- one step's inputs ------------------------------------------------------------------

    def _sync_row(self, state: CachedRequestState) -> int:
        row = self.row_of.get(state.req_id)
        if row is None:
            row = self.free_rows.pop()
            self.row_of[state.req_id] = row
        have, need = int(self.num_blocks_in_row[row]), len(state.block_ids)
        if need != have:
            self.block_table[row, have:need] = state.block_ids[have:need]
            self.num_blocks_in_row[row] = need
        return row

    def prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        """Build the step's inputs and advance each request's computed and pending counts."""
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec_decode = scheduler_output.scheduled_spec_decode_tokens
        count = len(num_scheduled)
        req_ids = list(num_scheduled)
        states = [self.requests[request_id] for request_id in req_ids]
        rows = np.fromiter((self._sync_row(s) for s in states), dtype=np.int64, count=count)
        num_new = np.fromiter(num_scheduled.values(), dtype=np.int64, count=count)
        starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=count)
        query_start_loc = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        seq_lens = starts + num_new
        max_query_len = int(num_new.max())
        pending_dst: list[int] = []
        pending_src: list[str] = []
        samples: list[bool] = []
        num_drafts: list[int] = []
        token_chunks: list[list[int]] = []
        for row, (state, start, n) in enumerate(zip(states, starts.tolist(), num_new.tolist())):
            end = start + n
            known = len(state.all_token_ids)
            drafts = spec_decode.get(state.req_id) if spec_decode else None
            num_drafts.append(len(drafts) if drafts else 0)
            if drafts:  # the last known token, then the drafts to verify (nothing is in flight)
                token_chunks.append(state.all_token_ids[start:known] + drafts)
                end -= len(drafts)
            elif end > known:  # the last input token was sampled by the step in flight
                pending_dst.append(int(query_start_loc[row]) + n - 1)
                pending_src.append(state.req_id)
                token_chunks.append(state.all_token_ids[start:known] + [0])
            else:
                token_chunks.append(state.all_token_ids[start:end])
            keeps = end == state.num_tokens_with_pending
            samples.append(keeps)
            state.num_computed_tokens = end + num_drafts[-1]
            if keeps:
                state.num_pending_tokens += 1
        if max_query_len == 1:
            positions = starts
            request_of_token = np.arange(count)
            input_ids = np.fromiter((c[0] for c in token_chunks), dtype=np.int64, count=count)
        else:
            request_of_token = np.repeat(np.arange(count), num_new)
            positions = starts[request_of_token] + (
                np.arange(int(query_start_loc[-1])) - query_start_loc[:-1][request_of_token]
            )
            input_ids = np.concatenate([np.asarray(chunk, dtype=np.int64) for chunk in token_chunks])
        bs = self.block_size
        slot_mapping = (
            self.block_table[rows[request_of_token], positions // bs].astype(np.int64) * bs + positions % bs
        )
        max_blocks = int(self.num_blocks_in_row[rows].max())
        return StepInputs(
            req_ids=req_ids,
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=self.block_table[rows, :max_blocks],
            max_query_len=max_query_len,
            num_decodes=int(np.count_nonzero(num_new == 1)),
            max_seq_len=int(seq_lens.max()),
            samples=samples,
            num_drafts=num_drafts,
            pending_dst=pending_dst,
            pending_src_req_ids=pending_src,
        )
