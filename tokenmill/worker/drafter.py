"""Speculative decoding's proposal side in the worker: after each step, once its tokens are on the host,
drafts for every request's next step. Two kinds:

- TextDrafter: a proposer that reads only the request's tokens (n-gram prompt lookup; the replay
  proposer of tests and benchmarks), request by request.
- ModelDrafter: a model drafts greedily, one batched forward per draft token: layer_skip (the target's
  first layers, final norm and LM head, reading the KV those layers already hold) or draft_model (a
  second model with its own KV cache in the same blocks, fed every step's inputs so its cache holds the
  request's text). The drafts' own KV goes into slots past the computed ones, which the scheduler
  allocates ahead (SpeculativeConfig.lookahead) and the verifying step overwrites.
- EagleDrafter: an EAGLE head (models/eagle.py) drafts from the target's hidden states of the step just
  run: one forward over every token of the step whose next token is known (writing the head's KV
  cache for them), then one per further draft, all on the device until the drafts are read.

Every drafter tells the runner which attention layers need KV cache (attention_layers) and sees the
step's inputs before (before_target) and after (after_target) the target's forward.

Verification of the drafts is the sampler's (Sampler.verify)."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.spec_decode import NgramProposer, SpeculativeConfig
from tokenmill.worker.input_batch import CachedRequestState, StepInputs
from tokenmill.worker.model_loader import build_model

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner


def draft_room(state: CachedRequestState, k: int | None) -> int | None:
    """How many drafts a request can take: k (None: any), capped by what max_tokens leaves after the
    target's own token."""
    max_tokens = state.sampling_params.max_tokens
    if max_tokens is None:
        return k
    room = max_tokens - state.num_output_tokens - 1
    return room if k is None else min(k, room)


class _Drafter:
    draft_model: torch.nn.Module | None = None

    def attention_layers(self) -> list:
        """Attention layers of the proposer's own, whose KV cache the runner allocates with the target's."""
        return []

    def before_target(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        """Sees a step's device inputs before the target's forward."""

    def after_target(self, inputs: StepInputs) -> None:
        """Sees a step's host inputs once the target's forward is launched."""

    def forget(self, request_id: str) -> None:
        """Drops what is kept for a finished request."""

    def draft_cost(self) -> float:
        """One draft token's cost as a fraction of a decode step of the target (by parameters read)."""
        return 0.0


class TextDrafter(_Drafter):
    """Drafts from the request's own tokens. `proposer` has propose(token_ids, max_tokens, request_id)
    and forget(request_id): NgramProposer, or a ReplayProposer set in its place."""

    def __init__(self, runner: ModelRunner, proposer) -> None:
        self.runner = runner
        self.proposer = proposer

    def propose(self, req_ids: list[str], samples: list[bool], wanted: bool = True) -> list[list[int]]:
        if not wanted:
            return [[] for _ in req_ids]
        states = self.runner.input_batch.requests
        out = []
        for request_id, keeps in zip(req_ids, samples):
            state = states.get(request_id)
            if not keeps or state is None:
                out.append([])
            else:
                room = draft_room(state, None)  # the proposer caps at its own k
                out.append(self.proposer.propose(state.all_token_ids, room, request_id=request_id))
        return out

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)


class ModelDrafter(_Drafter):
    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig) -> None:
        self.runner = runner
        self.k = spec.num_speculative_tokens
        self.draft_layers: int | None = None
        self.draft_model: torch.nn.Module | None = None
        if spec.method == "layer_skip":
            num_layers = len(runner.model.model.layers)
            if spec.draft_layers >= num_layers:
                raise ValueError(
                    f"speculative_config draft_layers ({spec.draft_layers}) must be fewer than the "
                    f"model's {num_layers} layers."
                )
            self.draft_layers = spec.draft_layers
        else:
            self.draft_model = self._build_draft_model(spec.model)

    def _build_draft_model(self, path: str) -> torch.nn.Module:
        """The draft model, in the target's dtype, unquantized; its vocabulary must be the target's."""
        from tokenmill.loader import resolve_model

        runner = self.runner
        source = resolve_model(path, "auto", None)
        if source.hf_config.vocab_size != runner.hf_config.vocab_size:
            raise ValueError(
                f"speculative_config model {path!r} has a vocabulary of {source.hf_config.vocab_size} "
                f"tokens, the target {runner.hf_config.vocab_size}: a draft model must share the target's "
                "tokenizer."
            )
        config = dataclasses.replace(runner.config, model=path, quantization=None, speculative_config=None)
        return build_model(config, source, runner.max_model_len, runner.device, runner.dtype, True)

    def attention_layers(self) -> list:
        return self.draft_model.attention_layers() if self.draft_model is not None else []

    def draft_cost(self) -> float:
        target = self.runner.model
        if self.draft_model is None:
            return self.draft_layers / len(target.model.layers)
        return _num_params(self.draft_model) / _num_params(target)

    def before_target(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> None:
        if self.draft_model is not None:
            # The draft model sees every token the target computes, so its own KV cache (in the same
            # blocks) holds the request's whole text when it drafts.
            self.draft_model(input_ids, positions, md)

    @torch.inference_mode()
    def propose(self, req_ids: list[str], samples: list[bool], wanted: bool = True) -> list[list[int]]:
        """k greedy drafts per request, one batched forward per draft, each reading the KV of the ones
        before it. Not wanted, nothing runs: with a step in flight (async scheduling), layer_skip's
        drafts would write the KV that step's target layers are writing."""
        if not wanted:
            return [[] for _ in req_ids]
        runner = self.runner
        batch = runner.input_batch
        bs = runner.block_size
        rows, budgets, tokens, positions = [], [], [], []
        for row, (request_id, keeps) in enumerate(zip(req_ids, samples)):
            state = batch.requests.get(request_id)
            if not keeps or state is None:
                continue
            position = len(state.all_token_ids) - 1  # the last token: its KV is not written yet
            room = min(
                draft_room(state, self.k),
                len(state.block_ids) * bs - position,  # the slots allocated ahead
                runner.max_model_len - position - 1,
            )
            if room > 0:
                rows.append(row)
                budgets.append(room)
                tokens.append(state.all_token_ids[-1])
                positions.append(position)
        drafts: list[list[int]] = [[] for _ in req_ids]
        if not rows:
            return drafts
        table_rows = np.asarray([batch.row_of[req_ids[r]] for r in rows], dtype=np.int64)
        steps = _one_token_steps(runner, table_rows, np.asarray(positions), np.asarray(budgets), max(budgets))
        (token,) = runner._staged([np.asarray(tokens, dtype=np.int64)], np.int64)
        drafted = []
        for pos_t, md in steps:
            if self.draft_model is not None:
                logits = self.draft_model.compute_logits(self.draft_model(token, pos_t, md))
            else:
                model = runner.model
                logits = model.compute_logits(model.model(token, pos_t, md, num_layers=self.draft_layers))
            token = logits.argmax(dim=-1)
            drafted.append(token)
        drafted_host = torch.stack(drafted).tolist()  # [steps, requests]: the one sync
        for i, (row, budget) in enumerate(zip(rows, budgets)):
            drafts[row] = [drafted_host[s][i] for s in range(budget)]
        return drafts


class EagleDrafter(_Drafter):
    def __init__(self, runner: ModelRunner, spec: SpeculativeConfig) -> None:
        from tokenmill.models.eagle import FeatureSink, build_eagle_head

        self.runner = runner
        self.k = spec.num_speculative_tokens
        target = runner.model
        self.head = build_eagle_head(
            spec.method, spec.model, target, runner.max_model_len, runner.device, runner.dtype
        )
        # Every forward of the target (eager, piecewise or whole-step graph) leaves its features here.
        max_tokens = max(runner.max_num_batched_tokens, runner.config.max_num_seqs * (1 + self.k))
        self.sink = FeatureSink(
            self.head.feature_layers, target.config.hidden_size, max_tokens, runner.dtype, runner.device
        )
        target.model.feature_sink = self.sink
        self._inputs: deque[tuple[StepInputs, torch.Tensor]] = deque()

    def attention_layers(self) -> list:
        return self.head.attention_layers()

    def draft_cost(self) -> float:
        target = self.runner.model
        head = _num_params(self.head)
        if not getattr(self.head, "own_lm_head", False):  # drafts through the target's LM head
            head += target.lm_head.weight.numel()
        return head / _num_params(target)

    def after_target(self, inputs: StepInputs) -> None:
        # The step's features, copied before a step launched behind it (async scheduling) overwrites
        # the buffer.
        features = self.sink.buffer[: len(inputs.input_ids)].clone()
        self._inputs.append((inputs, features))

    @torch.inference_mode()
    def propose(self, req_ids: list[str], samples: list[bool], wanted: bool = True) -> list[list[int]]:
        """The head's KV for every token of the step just run whose next token is now known (the
        accepted ones, and prompt tokens), always; and, when wanted, up to k drafts for each request that
        sampled: the first from that forward, each further one from a one-token step over the
        previous draft."""
        runner = self.runner
        drafts: list[list[int]] = [[] for _ in req_ids]
        # Steps launched since are queued behind this one (async scheduling); a step whose result is
        # never read leaves its entry behind, dropped here.
        while self._inputs and self._inputs[0][0].req_ids is not req_ids:
            self._inputs.popleft()
        if not self._inputs:
            return drafts
        inputs, step_features = self._inputs.popleft()
        batch, bs = runner.input_batch, runner.block_size
        rows, tokens, positions, slots, counts, seq_lens, table_rows = [], [], [], [], [], [], []
        drafting, budgets, bases = [], [], []  # per drafting request: its row in req_ids, k, next position
        for r, request_id in enumerate(req_ids):
            state = batch.requests.get(request_id)
            if state is None:
                continue
            start, end = int(inputs.query_start_loc[r]), int(inputs.query_start_loc[r + 1])
            first = int(inputs.positions[start])
            known = state.all_token_ids
            valid = min(end - start, len(known) - first - 1)  # rows whose next token is known
            if valid <= 0:
                continue
            rows.extend(range(start, start + valid))
            tokens.extend(known[first + 1 : first + 1 + valid])
            positions.extend(range(first, first + valid))
            slots.extend(inputs.slot_mapping[start : start + valid].tolist())
            counts.append(valid)
            seq_lens.append(first + valid)
            table_rows.append(batch.row_of[request_id])
            if wanted and samples[r]:
                base = len(known) - 1  # the first draft's KV position after the first forward's
                budget = min(
                    draft_room(state, self.k),
                    len(state.block_ids) * bs - base + 1,  # the slots allocated ahead
                    runner.max_model_len - len(known),
                )
                if budget > 0:
                    drafting.append((r, len(counts) - 1))
                    budgets.append(budget)
                    bases.append(base)
        if not rows:
            return drafts
        head = self.head
        table_rows_np = np.asarray(table_rows, dtype=np.int64)
        max_blocks = int(batch.num_blocks_in_row[table_rows_np].max())
        counts_np = np.asarray(counts, dtype=np.int64)
        ends = np.cumsum(counts_np)
        last_rows = ends[[i for _, i in drafting]] - 1 if drafting else np.zeros(0, dtype=np.int64)
        rows_t, ids_t, pos_t, slot_t, last_t = runner._staged(
            [np.asarray(rows), np.asarray(tokens), np.asarray(positions), np.asarray(slots), last_rows],
            np.int64,
        )
        qsl_t, seq_t, tables_t = runner._staged(
            [np.concatenate([[0], ends]).astype(np.int32), np.asarray(seq_lens, dtype=np.int32),
             batch.block_table[table_rows_np, :max_blocks]], np.int32,
        )  # fmt: skip
        md = AttentionMetadata(
            slot_mapping=slot_t, block_tables=tables_t, seq_lens=seq_t, query_start_loc=qsl_t,
            max_query_len=int(counts_np.max()), max_seq_len=max(seq_lens),
            num_decodes=int((counts_np == 1).sum()),
        )  # fmt: skip
        features = step_features.index_select(0, rows_t)
        hidden, features = head(ids_t, pos_t, md, features)
        if not drafting:
            return drafts
        token = head.draft_tokens(hidden.index_select(0, last_t))
        features = features.index_select(0, last_t)
        steps = [token]
        more = max(budgets) - 1
        if more > 0:
            steps += self._more_drafts(token, features, drafting, budgets, bases, table_rows_np, more)
        drafted = torch.stack(steps).tolist()  # [steps, drafting requests]: the one sync
        for i, ((r, _), budget) in enumerate(zip(drafting, budgets)):
            drafts[r] = [drafted[s][i] for s in range(budget)]
        return drafts

    def _more_drafts(
        self, token, features, drafting, budgets, bases, table_rows, steps
    ) -> list[torch.Tensor]:
        """Drafts 2..: one-token steps over every drafting request (a request past its budget computes
        into no slot, and its drafts are dropped)."""
        rows = table_rows[[i for _, i in drafting]]
        counts = np.asarray(budgets) - 1  # the first draft came from the step's own forward
        out = []
        for pos_t, md in _one_token_steps(self.runner, rows, np.asarray(bases), counts, steps):
            hidden, features = self.head(token, pos_t, md, features)
            token = self.head.draft_tokens(hidden)
            out.append(token)
        return out


def _one_token_steps(
    runner: ModelRunner, table_rows: np.ndarray, bases: np.ndarray, counts: np.ndarray, steps: int
) -> list[tuple[torch.Tensor, AttentionMetadata]]:
    """(positions, metadata) of `steps` one-token forwards over requests (rows of the block table):
    step s at position bases + s, written into its slot while s < counts, after that into none with a
    context of one (its token is dropped). Known ahead, so staged in two copies, not one per step."""
    batch, bs = runner.input_batch, runner.block_size
    step = np.arange(steps)[:, None]
    pos = bases.astype(np.int64)[None, :] + step
    active = counts[None, :] > step
    blocks = batch.block_table[table_rows[None, :], np.minimum(pos // bs, batch.block_table.shape[1] - 1)]
    slots = np.where(active, blocks.astype(np.int64) * bs + pos % bs, -1)
    seq_lens = np.where(active, pos + 1, 1).astype(np.int32)
    # A request past its budget (cut short by max_model_len too) computes at position 0: past the
    # context, its position would index past the rotary table.
    pos = np.where(active, pos, 0)
    max_blocks = int(batch.num_blocks_in_row[table_rows].max())
    pos_t, slot_t = runner._staged([pos, slots], np.int64)
    seq_t, tables_t, qsl_t = runner._staged(
        [
            seq_lens,
            batch.block_table[table_rows, :max_blocks],
            np.arange(len(table_rows) + 1, dtype=np.int32),
        ],
        np.int32,
    )
    return [
        (pos_t[s], AttentionMetadata(
            slot_mapping=slot_t[s], block_tables=tables_t, seq_lens=seq_t[s], query_start_loc=qsl_t,
            max_query_len=1, max_seq_len=int(seq_lens[s].max()), num_decodes=len(table_rows),
        ))
        for s in range(steps)
    ]  # fmt: skip


def _num_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def make_drafter(runner: ModelRunner, spec: SpeculativeConfig | None) -> _Drafter | None:
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return TextDrafter(runner, proposer)
    if spec.method in ("eagle", "eagle3"):
        return EagleDrafter(runner, spec)
    return ModelDrafter(runner, spec)
