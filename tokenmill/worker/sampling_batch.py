"""A step's sampling batch: each row's knobs and the flags OR-ed over the batch that say which of the
sampler's passes it needs (worker/sampler.py), built by the host loop every step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.worker.device import staged
from tokenmill.worker.input_batch import CachedRequestState


@dataclass
class SamplingBatch:
    """Per-row sampling state for one step, as device tensors where the math needs them."""

    requests: list[CachedRequestState]
    # Per-row knobs, None when every row is greedy.
    temperature: torch.Tensor | None  # [B] float32; 0 means greedy
    top_k: torch.Tensor | None  # [B] int64; vocab size means no top-k
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    all_greedy: bool
    needs_logit_edits: bool  # some row has a logit bias or is still under its min_tokens
    needs_top_k_p: bool
    needs_min_p: bool
    needs_penalties: bool
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    max_num_logprobs: int  # -1 when no row asks for logprobs
    # row -> its last output token, sampled by the step in flight and still only on the device
    pending_tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    # request -> how many of its output tokens were on the host when the batch was built (penalised
    # requests): a grammar step samples after the step before it landed, and the token that was pending
    # then (counted through pending_tokens) must not count again from the host's list.
    output_lens: dict[str, int] = field(default_factory=dict)
    # request -> its output tokens before the step's own (earlier steps' pending ones included) when the
    # batch was built, for min_tokens: the next step's host half may count its own pending token before a
    # grammar step samples.
    output_counts: dict[str, int] = field(default_factory=dict)
    # Speculative verification, per logit row: the drafts before this row's position, which count as
    # output tokens there if they stand (penalties and min_tokens see them). None outside verification.
    draft_prefixes: list[list[int]] | None = None


# What a row's sampling params ask for, as bits: OR-ed over the batch, they say which passes it needs.
_SAMPLED, _TOP_K_P, _MIN_P, _PENALTIES, _BIAS, _MIN_TOKENS, _SEEDED, _LOGPROBS = (1 << i for i in range(8))


def _row_knobs(request: CachedRequestState, vocab_size: int) -> tuple[tuple, int]:
    """((temperature, top-k, top-p, min-p), flags) of a request's sampling params, computed once: a step
    reads them for every row, and the params never change."""
    cached = request.sampling_knobs
    if cached is None or cached[0] != vocab_size:
        p = request.sampling_params
        top_k = p.top_k if p.top_k > 0 else vocab_size
        flags = (
            (0 if p.greedy else _SAMPLED)
            | (_TOP_K_P if top_k < vocab_size or p.top_p < 1 else 0)
            | (_MIN_P if p.min_p > 0 else 0)
            | (_PENALTIES if p.uses_penalties else 0)
            | (_BIAS if p.logit_bias or p.allowed_token_ids else 0)
            | (_MIN_TOKENS if p.min_tokens else 0)
            | (_SEEDED if p.seed is not None and not p.greedy else 0)
            | (_LOGPROBS if p.logprobs is not None else 0)
        )
        knobs = (0.0 if p.greedy else p.temperature, top_k, p.top_p, p.min_p)
        cached = request.sampling_knobs = (vocab_size, knobs, flags)
    return cached[1], cached[2]


def build_sampling_batch(
    requests: list[CachedRequestState],
    samples: list[bool],
    generators_of: dict,
    device: torch.device,
    vocab_size: int,
) -> SamplingBatch:
    """A step's SamplingBatch from its rows' request states (worker/input_batch.py's), the per-row knobs
    on the device in one copy. samples: whether each row keeps its token (a seeded request draws only
    then); generators_of: each seeded request's generator by id, kept across steps (filled here). The
    host loop builds one every step: the rows' knobs are cached on their states, and only what the
    batch's OR-ed flags ask for is looked at row by row."""
    rows = [_row_knobs(r, vocab_size) for r in requests]
    flags = 0
    for _, row_flags in rows:
        flags |= row_flags
    generators = {}
    if flags & _SEEDED:
        for row, (request, (_, row_flags)) in enumerate(zip(requests, rows)):
            # A seeded request draws only for tokens it keeps, so chunking and batching never shift it.
            if samples[row] and row_flags & _SEEDED:
                generator = generators_of.get(request.req_id)
                if generator is None:
                    generator = torch.Generator(device=device).manual_seed(request.sampling_params.seed)
                    generators_of[request.req_id] = generator
                generators[row] = generator
    all_greedy = not flags & _SAMPLED
    knobs = top_k = None
    if not all_greedy:
        # One host-to-device copy for the per-row knobs.
        knob_values = itertools.chain.from_iterable([knob for knob, _ in rows])
        table = np.fromiter(knob_values, np.float64, count=4 * len(rows)).reshape(len(rows), 4)
        knobs, top_k = staged([table[:, [0, 2, 3]].T, table[:, 1]], [np.float32, np.int64], device)

    def flagged(bit: int) -> list[CachedRequestState]:
        return [r for r, (_, row_flags) in zip(requests, rows) if row_flags & bit] if flags & bit else []

    # What penalties and min_tokens count, as it stands now: a grammar step samples later. The tokens
    # before this step's own, which input_batch.prepare has already counted as pending in a row that keeps
    # its sample.
    output_lens = {r.req_id: len(r.output_token_ids) for r in flagged(_PENALTIES)}
    output_counts = (
        {
            r.req_id: r.num_output_tokens - keeps
            for r, keeps, (_, row_flags) in zip(requests, samples, rows)
            if row_flags & _MIN_TOKENS
        }
        if flags & _MIN_TOKENS
        else {}
    )
    needs_logit_edits = bool(flags & _BIAS) or any(
        output_counts[r.req_id] < r.sampling_params.min_tokens for r in flagged(_MIN_TOKENS)
    )
    logprob_counts = [r.sampling_params.logprobs for r in flagged(_LOGPROBS)]
    return SamplingBatch(
        requests=requests,
        temperature=knobs[0] if knobs is not None else None,
        top_k=top_k,
        top_p=knobs[1] if knobs is not None else None,
        min_p=knobs[2] if knobs is not None else None,
        all_greedy=all_greedy,
        needs_logit_edits=needs_logit_edits,
        needs_top_k_p=bool(flags & _TOP_K_P),
        needs_min_p=bool(flags & _MIN_P),
        needs_penalties=bool(flags & _PENALTIES),
        output_lens=output_lens,
        generators=generators,
        max_num_logprobs=max(logprob_counts) if logprob_counts else -1,
        output_counts=output_counts,
    )
