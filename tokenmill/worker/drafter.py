"""Speculative decoding's proposal side in the worker: after each step, once its tokens are on the host,
drafts for every request's next step. Two kinds:

- TextDrafter: a proposer that reads only the request's tokens (n-gram prompt lookup; the replay
  proposer of tests and benchmarks), request by request.
- ModelDrafter: a model drafts greedily, one batched forward per draft token: layer_skip (the target's
  first layers, final norm and LM head, reading the KV those layers already hold) or draft_model (a
  second model with its own KV cache in the same blocks, fed every step's inputs so its cache holds the
  request's text). The drafts' own KV goes into slots past the computed ones, which the scheduler
  allocates ahead (SpeculativeConfig.lookahead) and the verifying step overwrites.

Verification of the drafts is the sampler's (Sampler.verify)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.layers.attention import AttentionMetadata
from tokenmill.spec_decode import NgramProposer, SpeculativeConfig
from tokenmill.worker.input_batch import CachedRequestState
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


class TextDrafter:
    """Drafts from the request's own tokens. `proposer` has propose(token_ids, max_tokens, request_id)
    and forget(request_id): NgramProposer, or a ReplayProposer set in its place."""

    draft_model = None

    def __init__(self, runner: ModelRunner, proposer) -> None:
        self.runner = runner
        self.proposer = proposer

    def propose(self, req_ids: list[str], samples: list[bool]) -> list[list[int]]:
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


class ModelDrafter:
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

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""

    @torch.inference_mode()
    def propose(self, req_ids: list[str], samples: list[bool]) -> list[list[int]]:
        """k greedy drafts per request, one batched forward per draft, each reading the KV of the ones
        before it."""
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
        for step in range(max(budgets, default=0)):
            active = [i for i, budget in enumerate(budgets) if budget > step]
            table_rows = np.asarray([batch.row_of[req_ids[rows[i]]] for i in active], dtype=np.int64)
            pos = np.asarray([positions[i] + step for i in active], dtype=np.int64)
            slots = batch.block_table[table_rows, pos // bs].astype(np.int64) * bs + pos % bs
            max_blocks = int(batch.num_blocks_in_row[table_rows].max())
            ids_t, pos_t, slot_t = runner._staged(
                [np.asarray([tokens[i] for i in active]), pos, slots], np.int64
            )
            seq_lens = (pos + 1).astype(np.int32)
            qsl_t, seq_t, tables_t = runner._staged(
                [np.arange(len(active) + 1, dtype=np.int32), seq_lens,
                 batch.block_table[table_rows, :max_blocks]], np.int32,
            )  # fmt: skip
            md = AttentionMetadata(
                slot_mapping=slot_t, block_tables=tables_t, seq_lens=seq_t, query_start_loc=qsl_t,
                max_query_len=1, max_seq_len=int(seq_lens.max()), num_decodes=len(active),
            )  # fmt: skip
            if self.draft_model is not None:
                logits = self.draft_model.compute_logits(self.draft_model(ids_t, pos_t, md))
            else:
                model = runner.model
                logits = model.compute_logits(model.model(ids_t, pos_t, md, num_layers=self.draft_layers))
            for i, token in zip(active, logits.argmax(dim=-1).tolist()):
                drafts[rows[i]].append(token)
                tokens[i] = token
        return drafts


def make_drafter(runner: ModelRunner, spec: SpeculativeConfig | None) -> TextDrafter | ModelDrafter | None:
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return TextDrafter(runner, proposer)
    return ModelDrafter(runner, spec)
