"""The pooling runner's pooler: one L2-normalised vector per prompt from the final hidden states, the
last token's or the mean over every prompt token. A mean keeps a running sum per request across prefill
chunks; a preempted request starts its sum again, as it recomputes its prompt from the start."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.worker.device import on_device
from tokenmill.worker.input_batch import StepInputs


class Pooler:
    def __init__(self, pooling_type: str, device: torch.device) -> None:
        self.pooling_type = pooling_type
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}  # mean pooling: hidden-state sums of chunks so far

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._sums.pop(request_id, None)

    def pool(
        self, hidden: torch.Tensor, inputs: StepInputs, num_prompt_tokens: dict[str, int]
    ) -> tuple[list[int], torch.Tensor]:
        """(rows whose prompt this step completes, their vectors [rows, hidden] in fp32)."""
        finished_rows = [row for row, done in enumerate(inputs.samples) if done]
        if self.pooling_type == "last":
            ends = (inputs.query_start_loc[1:] - 1)[finished_rows].tolist()
            pooled = hidden[on_device(ends, torch.int64, self.device)].float()
        else:
            lengths = np.diff(inputs.query_start_loc)
            token_rows = np.repeat(np.arange(len(lengths)), lengths).tolist()
            row_of_token = on_device(token_rows, torch.int64, self.device)
            sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=self.device)
            sums.index_add_(0, row_of_token, hidden[: len(row_of_token)].float())
            for row, request_id in enumerate(inputs.req_ids):
                earlier = self._sums.pop(request_id, None)
                if earlier is not None:
                    sums[row] += earlier
                if not inputs.samples[row]:
                    self._sums[request_id] = sums[row].clone()
            counts = [num_prompt_tokens[inputs.req_ids[row]] for row in finished_rows]
            divisor = on_device(counts, torch.float32, self.device)[:, None]
            pooled = sums[finished_rows] / divisor
        return finished_rows, torch.nn.functional.normalize(pooled, p=2, dim=-1)
