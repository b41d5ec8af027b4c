"""Speculative verification in the worker: which logit rows a verifying step reads (each request's
drafts' positions and its last) and the sampler's verification over them, the sampling batch expanded
to one entry per row."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from tokenmill.worker.input_batch import StepInputs
from tokenmill.worker.sampling_batch import SamplingBatch
from tokenmill.worker.step_output import PendingRunnerOutput

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


class VerifyRows(NamedTuple):
    """A verifying step's logit rows: each request's drafts' positions, then its last."""

    logit_rows: torch.Tensor  # [L] rows of the step's hidden states
    draft_ids: torch.Tensor  # [L] the draft each row checks, -1 at a request's last row
    request_of: torch.Tensor  # [L] each row's request (its row in the sampling batch)
    request_list: list[int]  # the same, on the host
    first_rows: list[int]  # per request, its first logit row
    drafts: list[list[int]]  # per request, its drafts


def verify_rows(runner: ModelRunner, inputs: StepInputs, drafts: dict[str, list[int]]) -> VerifyRows:
    """The logit rows verification needs (each request's drafts' positions and its last) and how
    they map back to the requests, staged to the device in one copy."""
    counts = np.asarray(inputs.num_drafts, dtype=np.int64) + 1
    ends = inputs.query_start_loc[1:].astype(np.int64)
    hidden_rows = np.concatenate([np.arange(end - n, end) for end, n in zip(ends, counts)])
    request_of = np.repeat(np.arange(len(counts)), counts)
    first_rows = np.cumsum(counts) - counts
    row_drafts = [drafts.get(request_id, []) for request_id in inputs.req_ids]
    draft_ids = np.full(hidden_rows.shape[0], -1, dtype=np.int64)
    for first, row in zip(first_rows, row_drafts):
        draft_ids[first : first + len(row)] = row
    logit_rows, draft_tensor, request_tensor = runner._staged([hidden_rows, draft_ids, request_of], np.int64)
    return VerifyRows(
        logit_rows, draft_tensor, request_tensor, request_of.tolist(), first_rows.tolist(), row_drafts
    )


def verify(
    runner: ModelRunner,
    inputs: StepInputs,
    batch: SamplingBatch,
    logits: torch.Tensor,
    rows: VerifyRows,
    prompt_logprobs: dict | None,
) -> PendingRunnerOutput:
    """Verify a step's drafts: the sampling batch repeated for every logit row of a request, each row
    seeing the drafts before it as output tokens (penalties, min_tokens) and a seeded request's
    rows drawing from its generator in turn; then the accepted prefix and the next token per
    request, resolved on the host, with a logprob entry per token for requests that ask."""

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, rows.request_of)

    expanded = dataclasses.replace(
        batch,
        requests=[batch.requests[r] for r in rows.request_list],
        temperature=take(batch.temperature),
        top_k=take(batch.top_k),
        top_p=take(batch.top_p),
        min_p=take(batch.min_p),
        # A seeded request's rows draw, in order, from its one generator.
        generators={i: batch.generators[r] for i, r in enumerate(rows.request_list) if r in batch.generators},
        draft_prefixes=[rows.drafts[r][: i - rows.first_rows[r]] for i, r in enumerate(rows.request_list)],
    )
    verified, logprobs = runner.sampler.verify(logits, expanded, rows.draft_ids)
    # Nothing is in flight while speculating: no later step reads these from the device.
    runner._last_sampled = verified.token
    runner._last_row_of = {}
    logprob_ks = [r.sampling_params.logprobs for r in expanded.requests]  # one per logit row
    return PendingRunnerOutput(
        runner, inputs, verified.token, logprobs, logprob_ks, prompt_logprobs,
        verified=verified, drafts=rows.drafts, first_rows=rows.first_rows,
    )  # fmt: skip
