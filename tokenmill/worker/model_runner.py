"""The model runner: owns the model and the KV cache tensors, turns a scheduler decision into flat
batch tensors (input ids, positions, slot mapping, block tables, sequence lengths), runs the forward
pass and samples on the device."""

from __future__ import annotations

import logging
from typing import NamedTuple

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache import cdiv
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.loader import ModelSource
from tokenmill.worker.cuda_graphs import DecodeGraphs, capture_step_graphs
from tokenmill.worker.device import resolve_device, resolve_dtype, staged
from tokenmill.worker.drafter import make_drafter
from tokenmill.worker.grammar_masks import GrammarMasks, HostMasks
from tokenmill.worker.input_batch import InputBatch, StepInputs
from tokenmill.worker.kv_layout import empty_kv_cache, kv_cache_layout
from tokenmill.worker.kv_offload import BlockRows, HostKVCache
from tokenmill.worker.model_loader import build_model, kv_cache_dtype
from tokenmill.worker.piecewise_graphs import PiecewiseGraphs
from tokenmill.worker.pooler import Pooler
from tokenmill.worker.sampler import Sampler, score_prompt_tokens
from tokenmill.worker.sampling_batch import SamplingBatch, build_sampling_batch
from tokenmill.worker.spec_verify import VerifyRows, verify, verify_rows
from tokenmill.worker.step_output import AwaitingGrammar, Launched, PendingRunnerOutput

logger = logging.getLogger(__name__)

# Default token budget of a step. On a CPU a step costs its tokens at full price (no idle device to
# fill), so a small budget keeps every step short and lets a request that arrives behind a long prompt
# in within a step or two. 512: an 8k-token prompt on the embedded model prefills in 38 chunks of about
# 0.2 s each on two AMX cores in bf16 (8.3 s in all; 256 took 76 chunks and 11.4 s, 1024 19 chunks of
# 0.4 s and 7.2 s), against one 34 s step at 8192; fp32 steps take about twice as long.
_GPU_DEFAULT_BATCHED_TOKENS = 8192
_CPU_DEFAULT_BATCHED_TOKENS = 512


class Prepared(NamedTuple):
    """A step whose host half is done (ModelRunner.prepare): its inputs staged, its device half to come."""

    scheduler_output: SchedulerOutput
    inputs: StepInputs | None  # None: a pooling step, run whole at launch
    scoring: list  # (row, state, start, tokens) of chunks that score prompt logprobs
    staged: tuple | None  # input_ids, positions, metadata, the pending gather's indices


class ModelRunner:
    def __init__(
        self, config: EngineConfig, source: ModelSource, max_model_len: int, pooling_type: str | None = None
    ) -> None:
        """pooling_type None: a generating runner; "last" or "mean": the pooling runner, whose steps
        return one L2-normalised vector per finished prompt instead of sampled tokens."""
        self.config = config
        self.pooling_type = pooling_type
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, source.hf_config, self.device)
        self.hf_config = source.hf_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._allocated_before = torch.cuda.memory_allocated()
        self.model = build_model(config, source, max_model_len, self.device, self.dtype, pooling_type is None)
        self.kv_dtype = kv_cache_dtype(config, self.device, self.dtype, self.model)
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.max_num_batched_tokens = config.max_num_batched_tokens or (
            _GPU_DEFAULT_BATCHED_TOKENS if self.device.type == "cuda" else _CPU_DEFAULT_BATCHED_TOKENS
        )
        self.input_batch = InputBatch(config.max_num_seqs, self.max_blocks_per_seq, self.block_size)
        # Speculative decoding's proposals for each request's next step (worker/drafter.py).
        self.drafter = make_drafter(self, config.speculative_config if pooling_type is None else None)
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        # The last launched step's sampled tokens on the device, and each request's row in it.
        self._last_sampled = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._last_row_of: dict[str, int] = {}
        self.grammar_masks = GrammarMasks(self.device, self.dtype)
        self.pooler = Pooler(pooling_type, self.device) if pooling_type is not None else None
        self.host_kv: HostKVCache | None = None  # the prefix cache's CPU tier (kv_offload_gib)
        self._block_rows: BlockRows | None = None
        # cuDNN's dense prefill belongs to the fast path; the torch reference backend stays pure.
        self.dense_prefill_ok = self.device.type == "cuda" and self.model.kernels.backend == "triton"

    def _attention_layers(self) -> list:
        """Every attention layer whose KV cache the engine allocates: the target's, then the draft's."""
        layers = list(self.model.attention_layers())
        if self.drafter is not None:
            layers += self.drafter.attention_layers()
        return layers

    def capture_cuda_graphs(self, max_num_batched_tokens: int) -> None:
        """Once the KV cache exists (the graphs bake in its addresses): worker/cuda_graphs.py."""
        self.decode_graphs, self.verify_graphs, self.piecewise_graphs = capture_step_graphs(
            self, max_num_batched_tokens
        )

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        layers = self._attention_layers()
        element = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * element for a in layers)

    def context_cost(self) -> float:
        """What attending to one earlier token costs a prompt token, as a fraction of the token's matmuls:
        4 FLOPs per head dimension per layer (scores and weighted sum) over 2 per matmul weight."""
        attention = sum(4 * a.num_heads * a.head_dim for a in self.model.attention_layers())
        matmul = sum(
            2 * p.numel()
            for name, p in self.model.named_parameters()
            if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name
        )
        return attention / matmul

    def allocate_kv_cache(self, num_blocks: int) -> None:
        layout = kv_cache_layout(self.device, self.kv_dtype)
        for attn in self._attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            # Left uninitialised: attention uses only slots a request has written and masks (or zeroes)
            # the rest of its blocks, so zeroing gigabytes would buy nothing.
            attn.k_cache = empty_kv_cache(*shape, self.kv_dtype, self.device, layout)
            attn.v_cache = empty_kv_cache(*shape, self.kv_dtype, self.device, layout)

    def block_rows(self) -> BlockRows:
        """The KV cache's blocks as rows of bytes, for prefill/decode disaggregation's transfers."""
        if self._block_rows is None:
            self._block_rows = BlockRows(self._attention_layers(), self.device)
        return self._block_rows

    def export_blocks(self, block_ids: list[int]) -> bytes:
        """The KV of finished work's blocks, for a decode peer (blocks a step no longer writes)."""
        return self.block_rows().export(block_ids)

    def allocate_host_kv_cache(
        self, num_blocks: int, disk_dir: str | None = None, num_disk_blocks: int = 0
    ) -> None:
        self.host_kv = HostKVCache(
            self._attention_layers(), num_blocks, self.device, disk_dir, num_disk_blocks
        )

    # ---- one step ---------------------------------------------------------------------------

    def _staged(self, arrays: list[np.ndarray], dtype: np.dtype | list[np.dtype]) -> list[torch.Tensor]:
        return staged(arrays, dtype, self.device)

    def to_device(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's inputs on the device, the previous step's tokens gathered in (prepare, then launch's
        half)."""
        input_ids, positions, md, pending, _ = self._stage(inputs)
        self._gather_pending(input_ids, pending)
        return input_ids, positions, md

    def _stage(self, inputs: StepInputs, grammar_req_ids: list[str] | None = None) -> tuple:
        """The step's host arrays on the device in one pinned copy; input_ids hold a placeholder where
        the previous step's sampled token goes (`_gather_pending`, which must follow that sampling).
        grammar_req_ids: a step's constrained requests, whose logit rows (each request's last: a step
        without drafts) travel in the same copy, for the masks (_sample)."""
        pending_rows = [self._last_row_of[r] for r in inputs.pending_src_req_ids]
        index_arrays = [np.asarray(inputs.pending_dst, np.int64), np.asarray(pending_rows, np.int64)]
        if grammar_req_ids:
            position = {request_id: i for i, request_id in enumerate(inputs.req_ids)}
            index_arrays.append(np.fromiter(map(position.__getitem__, grammar_req_ids), np.int64))
        staged = self._staged(
            [inputs.input_ids, inputs.positions, inputs.slot_mapping, *index_arrays,
             inputs.query_start_loc, inputs.seq_lens, inputs.block_tables],
            [np.int64] * (3 + len(index_arrays)) + [np.int32] * 3,
        )  # fmt: skip
        input_ids, positions, slot_mapping, pending_dst, pending_src = staged[:5]
        grammar_rows = staged[5] if grammar_req_ids else None
        query_start_loc, seq_lens, block_tables = staged[-3:]
        md = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            num_decodes=inputs.num_decodes,
            dense_prefill=(
                self.dense_prefill_ok
                and len(inputs.seq_lens) == 1
                and inputs.max_query_len == inputs.max_seq_len
            ),
        )
        return input_ids, positions, md, (pending_dst, pending_src) if pending_rows else None, grammar_rows

    def _for_sampling(
        self, inputs: StepInputs, drafts: dict[str, list[int]] | None
    ) -> tuple[SamplingBatch, VerifyRows | None]:
        """The step's sampling batch and, for a step that verifies drafts, its logit rows on the device."""
        requests = [self.input_batch.requests[r] for r in inputs.req_ids]
        batch = build_sampling_batch(
            requests, inputs.samples, self.generators, self.device, self.hf_config.vocab_size
        )
        return batch, verify_rows(self, inputs, drafts) if drafts else None

    @staticmethod
    def _logit_rows(md: AttentionMetadata, rows: VerifyRows | None) -> torch.Tensor:
        """Every verified position's row (a verifying step), else each request's last."""
        return rows.logit_rows if rows is not None else md.query_start_loc[1:].long() - 1

    def _gather_pending(self, input_ids: torch.Tensor, pending: tuple | None) -> None:
        if pending is not None:
            # Tokens the previous step sampled feed this step straight from the device.
            pending_dst, pending_src = pending
            input_ids.index_copy_(0, pending_dst, self._last_sampled.index_select(0, pending_src))

    def _pending_views(self, inputs: StepInputs, batch: SamplingBatch) -> None:
        """The penalties' view of each row's token still on the device (the previous step's sample)."""
        if batch.needs_penalties:
            row_of_pending = {r: i for i, r in enumerate(inputs.req_ids)}
            for request_id in inputs.pending_src_req_ids:
                row, last_row = row_of_pending[request_id], self._last_row_of[request_id]
                batch.pending_tokens[row] = self._last_sampled[last_row : last_row + 1]

    def execute(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput | AwaitingGrammar:
        """Launch one step on the device; the returned output's result() waits for the tokens. A step
        that samples under a grammar stops before sampling: its AwaitingGrammar takes the step's masks
        (which the core computes while the forward pass runs) and returns the pending output."""
        return self.launch(self.prepare(scheduler_output))

    @torch.inference_mode()
    def prepare(self, scheduler_output: SchedulerOutput) -> Prepared:
        """The host's half of a step: KV copies, the batch's state, the inputs staged to the device. It
        reads nothing the previous step's sampling writes, so the engine core runs it while a grammar
        step's masks are filled, before that step samples; launch() follows that sampling."""
        out = scheduler_output
        if out.kv_saves or out.kv_loads or out.kv_spills or out.kv_disk_reads:
            assert self.host_kv is not None
            self.host_kv.transfer(out.kv_saves, out.kv_loads, out.kv_spills, out.kv_disk_reads)
        for block_ids, data in scheduler_output.kv_recvs:
            self.block_rows().import_(block_ids, data)
        self.input_batch.update_states(scheduler_output)
        for request_id in scheduler_output.finished_req_ids:
            self.generators.pop(request_id, None)
            if self.drafter is not None:
                self.drafter.forget(request_id)
        if self.pooling_type is not None:
            return Prepared(scheduler_output, None, [], None)
        states = self.input_batch.requests
        # Requests asking for prompt logprobs whose chunk still scores prompt tokens need every row's
        # hidden state, which only the eager path keeps (read before prepare advances the counts).
        scoring = [
            (row, states[request_id], states[request_id].num_computed_tokens, num_new)
            for row, (request_id, num_new) in enumerate(scheduler_output.num_scheduled_tokens.items())
            if states[request_id].sampling_params.prompt_logprobs is not None
            and states[request_id].num_computed_tokens + 1 < states[request_id].num_prompt_tokens
        ]
        inputs = self.input_batch.prepare(scheduler_output)
        # A verifying step's rows are known only at launch: its constrained requests' rows are staged then.
        grammar = (
            scheduler_output.grammar_req_ids if not scheduler_output.scheduled_spec_decode_tokens else None
        )
        return Prepared(scheduler_output, inputs, scoring, self._stage(inputs, grammar))

    @torch.inference_mode()
    def launch(self, prepared: Prepared) -> PendingRunnerOutput | AwaitingGrammar:
        """The device's half: the previous step's tokens gathered in, the forward pass, its logits; then
        sampling, or an AwaitingGrammar for the masks. What only sampling needs (the sampling batch, a
        verifying step's rows) is built once the forward pass is queued: off the host's path to the
        device, which a speculating loop cannot hide. Nothing between prepare() and launch() changes the
        request states it reads."""
        scheduler_output, inputs, scoring, staged_inputs = prepared
        if inputs is None:
            return self._execute_pooling(scheduler_output)
        input_ids, positions, md, pending, grammar_rows = staged_inputs
        self._gather_pending(input_ids, pending)
        prompt_logprobs = None
        if self.drafter is not None:
            self.drafter.before_target(input_ids, positions, md)
        if self.decode_graphs is not None and not scoring and self.decode_graphs.can_run(inputs):
            logits = self.decode_graphs.run(input_ids, positions, md)
            batch, rows = self._for_sampling(inputs, None)  # one token a request: its last row
        elif self.verify_graphs is not None and not scoring and self.verify_graphs.can_run(inputs):
            all_logits = self.verify_graphs.run(input_ids, positions, md)  # every token row's, one graph
            batch, rows = self._for_sampling(inputs, scheduler_output.scheduled_spec_decode_tokens)
            logits = all_logits[self._logit_rows(md, rows)]
        else:
            piecewise = self.piecewise_graphs
            if piecewise is not None and not scoring and piecewise.can_run(input_ids.shape[0], md):
                hidden = piecewise.run(input_ids, positions, md)
            else:
                hidden = self.model(input_ids, positions, md)
            batch, rows = self._for_sampling(inputs, scheduler_output.scheduled_spec_decode_tokens)
            logits = self.model.compute_logits(hidden[self._logit_rows(md, rows)])
            if scoring:
                prompt_logprobs = score_prompt_tokens(self.model, hidden, inputs.query_start_loc, scoring)
        self._pending_views(inputs, batch)
        # The next step's inputs read this step's tokens by these rows (set now, so that its prepare
        # need not wait for a deferred sampling).
        self._last_row_of = {request_id: row for row, request_id in enumerate(inputs.req_ids)}
        step = Launched(scheduler_output, inputs, batch, logits, rows, prompt_logprobs, grammar_rows)
        launched = AwaitingGrammar(self, step) if scheduler_output.grammar_req_ids else self._sample(step)
        if self.drafter is not None:
            self.drafter.after_target(launched.inputs)
        return launched

    @torch.inference_mode()
    def _sample(
        self, step: Launched, grammar_bitmask: np.ndarray | HostMasks | None = None
    ) -> PendingRunnerOutput:
        """The sampling half of a step: the grammar's masks first, then verification or sampling."""
        inputs, batch, logits, rows = step.inputs, step.sampling_batch, step.logits, step.rows
        if grammar_bitmask is not None:
            index = step.grammar_rows
            if index is None:
                index = self._grammar_rows(step.scheduler_output, inputs, rows)
            self.grammar_masks.apply(logits, index, grammar_bitmask)
        if rows is not None:
            pending = verify(self, inputs, batch, logits, rows, step.prompt_logprobs)
        else:
            sampled, logprobs = self.sampler(logits, batch)
            self._last_sampled = sampled  # its rows: _last_row_of, set at launch
            logprob_ks = [r.sampling_params.logprobs for r in batch.requests]
            pending = PendingRunnerOutput(self, inputs, sampled, logprobs, logprob_ks, step.prompt_logprobs)
        pending.propose_drafts = step.scheduler_output.propose_drafts
        return pending

    def _grammar_rows(
        self, out: SchedulerOutput, inputs: StepInputs, rows: VerifyRows | None
    ) -> torch.Tensor:
        """The logit row of each constrained request, on the device, where prepare did not stage them (a
        verifying step's: a request's last, since constrained requests take no drafts)."""
        position = {request_id: i for i, request_id in enumerate(inputs.req_ids)}
        logit_rows = []
        for request_id in out.grammar_req_ids:
            i = position[request_id]
            logit_rows.append(i if rows is None else rows.first_rows[i] + len(rows.drafts[i]))
        (index,) = self._staged([np.asarray(logit_rows, np.int64)], np.int64)
        return index

    # ---- speculative decoding ---------------------------------------------------------------

    def propose(self, req_ids: list[str], samples: list[bool], wanted: bool) -> list[list[int]] | None:
        """Drafts for each row's next step (after its tokens reached the host), [] where the request takes
        none or none are wanted; None without speculation."""
        return None if self.drafter is None else self.drafter.propose(req_ids, samples, wanted)

    def _execute_pooling(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        """One step of the pooling runner: the forward pass, then a vector for every request whose
        prompt this step completes; the step's "sampled" tokens are placeholders nobody reads."""
        assert self.pooler is not None
        self.pooler.forget([*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids])
        inputs = self.input_batch.prepare(scheduler_output)
        input_ids, positions, md = self.to_device(inputs)
        hidden = self.model(input_ids, positions, md)
        num_prompt_tokens = {r: self.input_batch.requests[r].num_prompt_tokens for r in inputs.req_ids}
        pooled = self.pooler.pool(hidden, inputs, num_prompt_tokens)
        sampled = torch.zeros(len(inputs.req_ids), dtype=torch.int64, device=self.device)
        self._last_sampled = sampled
        self._last_row_of = {request_id: row for row, request_id in enumerate(inputs.req_ids)}
        return PendingRunnerOutput(self, inputs, sampled, None, [], None, pooled)

    @torch.inference_mode()
    def profile_free_memory(self, num_tokens: int) -> int:
        """Bytes left for the KV cache under gpu_memory_utilization, after a forward pass of the
        largest batch (num_tokens as one prefill) has shown the activations' peak."""
        num_blocks = cdiv(num_tokens, self.block_size)
        self.allocate_kv_cache(num_blocks)
        scratch_bytes = num_blocks * self.kv_bytes_per_block()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        # The budget may exceed max_model_len (many requests per step); keep positions inside the rope table.
        positions = torch.arange(num_tokens, device=self.device) % self.max_model_len
        md = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, device=self.device),
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None, :],
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            max_query_len=num_tokens,
            max_seq_len=num_tokens,
        )
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions, md)
        if self.pooling_type is None:
            num_rows = min(num_tokens, self.config.max_num_seqs)
            self.model.compute_logits(hidden[-num_rows:]).float().softmax(dim=-1)
        torch.cuda.synchronize()
        # Weights plus the activation peak, this engine's own share of the allocator.
        peak = torch.cuda.max_memory_allocated() - self._allocated_before - scratch_bytes
        self.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # Headroom for the CUDA graphs' private pool and allocator fragmentation.
        reserve = 512 << 20
        # gpu_memory_utilization is this engine's share of the card, as in vLLM: two engines at 0.45
        # each fit one GPU. What others hold (other processes, engines built before) only caps it
        # through what is free now.
        budget = total * self.config.gpu_memory_utilization - peak - reserve
        return int(min(budget, free - reserve))
