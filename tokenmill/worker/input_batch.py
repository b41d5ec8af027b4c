"""Host-side batch preparation: a persistent block table (one row per running request, updated only
where a request gained blocks) and vectorised construction of the flat varlen step inputs."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tokenmill.core.scheduler import SchedulerOutput


class StepInputs(NamedTuple):
    """One step's inputs as host arrays, ready to be copied to the device."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    block_tables: np.ndarray  # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks_in_row = np.zeros(max_num_reqs, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            row = self.row_of.pop(request_id, None)
            if row is not None:
                self.num_blocks_in_row[row] = 0
                self.free_rows.append(row)

    def _sync_row(self, request) -> int:
        row = self.row_of.get(request.request_id)
        if row is None:
            row = self.free_rows.pop()
            self.row_of[request.request_id] = row
        have, need = int(self.num_blocks_in_row[row]), len(request.block_ids)
        if need != have:
            self.block_table[row, have:need] = request.block_ids[have:need]
            self.num_blocks_in_row[row] = need
        return row

    def prepare(self, scheduler_output: SchedulerOutput) -> StepInputs:
        self.release(scheduler_output.finished_req_ids)
        self.release(scheduler_output.preempted_req_ids)
        scheduled = scheduler_output.scheduled
        rows = np.fromiter((self._sync_row(r) for r, _ in scheduled), dtype=np.int64, count=len(scheduled))
        num_new = np.fromiter((n for _, n in scheduled), dtype=np.int64, count=len(scheduled))
        starts = np.fromiter(
            (r.num_computed_tokens for r, _ in scheduled), dtype=np.int64, count=len(scheduled)
        )
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(num_new, out=query_start_loc[1:])
        seq_lens = starts + num_new
        max_query_len = int(num_new.max())
        if max_query_len == 1:
            positions = starts
            request_of_token = np.arange(len(scheduled))
            input_ids = np.fromiter(
                (r.all_token_ids[r.num_computed_tokens] for r, _ in scheduled),
                dtype=np.int64,
                count=len(scheduled),
            )
        else:
            request_of_token = np.repeat(np.arange(len(scheduled)), num_new)
            positions = starts[request_of_token] + (
                np.arange(int(query_start_loc[-1])) - query_start_loc[:-1][request_of_token]
            )
            input_ids = np.concatenate(
                [
                    np.asarray(r.all_token_ids[s : s + n], dtype=np.int64)
                    for (r, n), s in zip(scheduled, starts)
                ]
            )
        bs = self.block_size
        slot_mapping = (
            self.block_table[rows[request_of_token], positions // bs].astype(np.int64) * bs + positions % bs
        )
        max_blocks = int(self.num_blocks_in_row[rows].max())
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc.astype(np.int32),
            seq_lens=seq_lens.astype(np.int32),
            block_tables=self.block_table[rows, :max_blocks],
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens.max()),
        )
