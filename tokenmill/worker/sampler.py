"""Sampling on the device: logit processors (bias, allowed tokens, min_tokens, penalties), then greedy
or random sampling with temperature, top-k, top-p and min-p (on a GPU, greedy and temperature alone in one
launch: kernels/sample.py). Seeded requests draw from their own generator, so their output does not depend
on what else is in the batch."""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.core.outputs import TokenLogprobs
from tokenmill.worker.device import on_device
from tokenmill.worker.sampling_batch import SamplingBatch


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    vocab_size = logits.shape[1]
    for row, request in enumerate(batch.requests):
        params = request.sampling_params
        if not params.uses_penalties:
            continue
        prefix = batch.draft_prefixes[row] if batch.draft_prefixes else []
        landed = batch.output_lens.get(request.req_id, len(request.output_token_ids))
        output_ids = on_device(request.output_token_ids[:landed] + prefix, torch.int64, logits.device)
        if row in batch.pending_tokens:
            output_ids = torch.cat([output_ids, batch.pending_tokens[row]])
        counts = torch.zeros(vocab_size, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(0, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
        if params.repetition_penalty != 1.0:
            # Prompt and output tokens both count for the repetition penalty (the CTRL/HF definition).
            seen = counts > 0
            seen.index_fill_(0, on_device(request.prompt_token_ids, torch.int64, logits.device), True)
            row_logits = logits[row]
            penalised = torch.where(
                row_logits > 0, row_logits / params.repetition_penalty, row_logits * params.repetition_penalty
            )
            logits[row] = torch.where(seen, penalised, row_logits)
        logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            logits.dtype
        )


def _apply_bias_and_min_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    draft_prefixes = batch.draft_prefixes
    for row, request in enumerate(batch.requests):
        params = request.sampling_params
        if params.logit_bias:
            ids = on_device(list(params.logit_bias.keys()), torch.int64, logits.device)
            bias = on_device(list(params.logit_bias.values()), logits.dtype, logits.device)
            logits[row].index_add_(0, ids, bias)
        if params.allowed_token_ids:
            allowed = on_device(params.allowed_token_ids, torch.int64, logits.device)
            kept = logits[row].index_select(0, allowed)
            logits[row].fill_(float("-inf")).index_copy_(0, allowed, kept)
        num_before = len(draft_prefixes[row]) if draft_prefixes else 0
        num_outputs = batch.output_counts.get(request.req_id, request.num_output_tokens)
        if num_outputs + num_before < params.min_tokens:
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned |= request.eos_token_ids
            if banned:
                # index_fill_ on the row: indexing with (int, tensor) turns the int into a tensor through a
                # pageable copy, which waits for the device.
                banned_ids = on_device(sorted(banned), torch.int64, logits.device)
                logits[row].index_fill_(0, banned_ids, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab_ranks = torch.arange(logits.shape[1], device=logits.device)
    mask = vocab_ranks[None, :] >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p; the first token always stays.
    mask |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row of probs [B, V] (non-negative, rows need not sum to 1), a seeded row drawing
    from its own generator."""
    if probs.device.type == "cpu":
        # Inverse CDF, one uniform draw a row: the first token whose cumulative mass reaches x, x in
        # (0, total], so a token of no mass is never drawn. On a CPU a vocabulary of exponential draws a
        # row costs 18x this (64 x 49,152: 105 ms against 5.8 ms on two cores).
        u = torch.rand(probs.shape[0], 1, dtype=probs.dtype)
        for row, generator in generators.items():
            u[row] = torch.rand((), dtype=probs.dtype, generator=generator)
        cdf = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (1 - u) * cdf[:, -1:])[:, 0]
        # A row with every token masked (NaN mass) gives token 0, as argmax and kernels/sample.py do.
        return picked.masked_fill(picked >= probs.shape[-1], 0)
    # Exponential race (Gumbel-max in disguise): argmax(p / q), q ~ Exp(1), samples from p with no sync.
    q = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div(q).argmax(dim=-1)


def score_tokens(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """For rows of log-probabilities and one token per row: the token's logprob, its rank, and the
    top-k ids and logprobs, left on the device."""
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(max(k, 1), dim=-1)
    return LogprobTensors(chosen, ranks, top_ids[:, :k], top_lp[:, :k])


class LogprobTensors(NamedTuple):
    logprobs: torch.Tensor  # [rows] float32
    ranks: torch.Tensor  # [rows] int64
    top_token_ids: torch.Tensor  # [rows, k] int64
    top_logprobs: torch.Tensor  # [rows, k] float32

    def to_host(self, non_blocking: bool) -> LogprobTensors:
        return LogprobTensors(*(t.to("cpu", non_blocking=non_blocking) for t in self))

    def tolist(self, ks: list[int | None]) -> list[TokenLogprobs | None]:
        """One entry per row, with that row's own number of alternatives (None: the row asked none)."""
        chosen, ranks, top_ids, top_lp = (t.tolist() for t in self)
        return [
            None if k is None else TokenLogprobs(chosen[row], ranks[row], top_ids[row][:k], top_lp[row][:k])
            for row, k in enumerate(ks)
        ]


class Verified(NamedTuple):
    """Speculative verification, one entry per logit row (a request's drafts' positions, then its
    last), on the device: resolved per request on the host (resolve_drafts)."""

    accepted: torch.Tensor  # [L] bool: the row's draft stands (False where there is none)
    token: torch.Tensor  # [L] the target's token there: a rejected draft's replacement, or the next one


def _one_launch_switch(value: str) -> bool:
    if value not in ("0", "1"):
        raise ValueError(f"TOKENMILL_ONE_LAUNCH_SAMPLING={value!r}: 1 (on) or 0 (the torch form, for A/B)")
    return value == "1"


ONE_LAUNCH_SAMPLING = _one_launch_switch(os.environ.get("TOKENMILL_ONE_LAUNCH_SAMPLING", "1"))


def one_launch(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Whether kernels/sample.py samples this batch: on a GPU, with no logit edits, penalties, top-k/p,
    min-p, seeded generators or logprobs in it (those take the torch form)."""
    return (
        ONE_LAUNCH_SAMPLING
        and logits.is_cuda
        and not (batch.needs_logit_edits or batch.needs_penalties or batch.needs_top_k_p or batch.needs_min_p)
        and not batch.generators
        and batch.max_num_logprobs < 0
    )


class Sampler:
    def __init__(self) -> None:
        # The one-launch kernel's noise: a new seed each step, counted up from one drawn from torch's
        # default generator at the first (so torch.manual_seed makes a run repeat).
        self._seed: int | None = None

    def _process(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(greedy tokens [B], the sampling distribution [B, V] or None when every row is greedy)
        after the logit processors, temperature, top-k, top-p and min-p."""
        raw_logits = logits
        logits = logits.float()
        if batch.needs_logit_edits or batch.needs_penalties:
            if logits is raw_logits:  # fp32 logits: edit a copy, logprobs are of the raw ones
                logits = logits.clone()
            if batch.needs_logit_edits:
                _apply_bias_and_min_tokens(logits, batch)
            if batch.needs_penalties:
                _apply_penalties(logits, batch)
        # The first index of the largest logit, as argmax; max(dim).indices gives the same (ties
        # included) and on a CPU takes a third of argmax's time (16 x 49,152 fp32: 162 vs 511 us).
        greedy = logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy, None
        temperature = batch.temperature
        scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
        if batch.needs_top_k_p:
            scaled = _top_k_top_p(scaled, batch.top_k, batch.top_p)
        probs = scaled.softmax(dim=-1)
        if batch.needs_min_p:
            max_prob = probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < batch.min_p[:, None] * max_prob, 0.0)
        return greedy, probs

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, LogprobTensors | None]:
        """Returns (sampled token ids [B] and, when a row asks for them, logprobs), on the device."""
        if one_launch(logits, batch):
            from tokenmill.kernels.sample import sample_rows

            self._seed = int(torch.randint(0, 2**62, ())) if self._seed is None else self._seed + 1
            return sample_rows(logits, None if batch.all_greedy else batch.temperature, self._seed), None
        greedy, probs = self._process(logits, batch)
        if probs is None:
            sampled = greedy
        else:
            sampled = torch.where(batch.temperature > 0, _random_sample(probs, batch.generators), greedy)
        return sampled, self._logprobs(logits, sampled, batch)

    def verify(
        self, logits: torch.Tensor, batch: SamplingBatch, drafts: torch.Tensor
    ) -> tuple[Verified, LogprobTensors | None]:
        """Speculative verification over logit rows (batch expanded to one entry per row; drafts [L],
        -1 where a row has no draft). A greedy row accepts its draft when it is the target's argmax, and
        replaces it by the argmax. A sampled row accepts draft d with probability p(d), p the target's
        distribution there (the draft came from a deterministic proposer: q is one-hot), and replaces a
        rejected one by a sample of p without d: together exactly p (Leviathan et al., 2023)."""
        greedy, probs = self._process(logits, batch)
        has_draft = drafts >= 0
        if probs is None:
            token = greedy
            accepted = has_draft & (greedy == drafts)
        else:
            sampled = batch.temperature > 0
            safe = drafts.clamp(min=0)
            p_draft = probs.gather(1, safe[:, None])[:, 0]
            coin = torch.rand(p_draft.shape, device=p_draft.device)
            for row, generator in batch.generators.items():  # a seeded request draws from its own
                coin[row] = torch.rand((), device=coin.device, generator=generator)
            accepted = has_draft & torch.where(sampled, coin < p_draft, greedy == drafts)
            # One draw per row: from p without the draft where there is one (only read if it is
            # rejected; a draft of probability 1 never is), from p itself at a request's last row.
            residual = torch.where(has_draft[:, None], probs.scatter(1, safe[:, None], 0.0), probs)
            token = torch.where(sampled, _random_sample(residual, batch.generators), greedy)
        # The token that stands at each row if the drafts before it stood: its logprob is reported.
        chosen = torch.where(accepted, drafts, token)
        return Verified(accepted, token), self._logprobs(logits, chosen, batch)

    @staticmethod
    def _logprobs(logits: torch.Tensor, sampled: torch.Tensor, batch: SamplingBatch) -> LogprobTensors | None:
        if batch.max_num_logprobs < 0:
            return None
        return score_tokens(logits.float().log_softmax(dim=-1), sampled, batch.max_num_logprobs)


def resolve_drafts(
    verified: list[list[int]], drafts: list[list[int]], first_rows: list[int]
) -> list[list[int]]:
    """Per request: its accepted drafts, then the target's own token (at the first rejected draft, or
    after the last draft). verified is (accepted, token) as host lists; first_rows[r] is request r's
    first logit row."""
    accepted, token = verified
    tokens = []
    for first, row_drafts in zip(first_rows, drafts):
        count = 0
        while count < len(row_drafts) and accepted[first + count]:
            count += 1
        tokens.append(row_drafts[:count] + [token[first + count]])
    return tokens


# Prompt rows scored at once: slices bound the [rows, vocab] fp32 buffer on long prompts.
_PROMPT_LOGPROB_ROWS = 512


def score_prompt_tokens(
    model, hidden: torch.Tensor, query_start_loc: np.ndarray, scoring: list
) -> dict[str, tuple[int, list]]:
    """Score the prompt tokens this step's chunks predict: the row at position p scores token p + 1.
    Scores stay on the device (as LogprobTensors per slice) until the step's result is read."""
    result = {}
    for row, request, start, num_new in scoring:
        num_scored = min(start + num_new, request.num_prompt_tokens - 1) - start
        first_row = int(query_start_loc[row])
        k = request.sampling_params.prompt_logprobs
        parts = []
        for offset in range(0, num_scored, _PROMPT_LOGPROB_ROWS):
            count = min(_PROMPT_LOGPROB_ROWS, num_scored - offset)
            rows = hidden[first_row + offset : first_row + offset + count]
            logprobs = model.compute_logits(rows).float().log_softmax(dim=-1)
            targets = request.all_token_ids[start + offset + 1 : start + offset + 1 + count]
            target_ids = on_device(targets, torch.int64, hidden.device)
            parts.append(score_tokens(logprobs, target_ids, k))
        scored = LogprobTensors(*(torch.cat(column) for column in zip(*parts)))
        result[request.req_id] = (start + 1, scored.to_host(non_blocking=hidden.device.type == "cuda"))
    return result
