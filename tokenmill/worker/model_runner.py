"""The model runner: owns the model and the KV cache tensors, turns a scheduler decision into flat
batch tensors (input ids, positions, slot mapping, block tables, sequence lengths), runs the forward
pass and samples on the device."""

from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache import cdiv
from tokenmill.core.outputs import ModelRunnerOutput, TokenLogprobs
from tokenmill.core.scheduler import SchedulerOutput
from tokenmill.kernels import get_kernels
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.loader import ModelSource
from tokenmill.models.registry import model_class
from tokenmill.worker.cuda_graphs import DecodeGraphs
from tokenmill.worker.device import resolve_device, resolve_dtype
from tokenmill.worker.input_batch import InputBatch, StepInputs
from tokenmill.worker.sampler import Sampler, SamplingBatch, score_tokens

logger = logging.getLogger(__name__)

_PROMPT_LOGPROB_ROWS = 512


class PendingRunnerOutput:
    """Sampled tokens still on the device; result() copies them to the host (the step's one sync)."""

    def __init__(
        self, sampled: torch.Tensor, logprobs: list | None, prompt_logprobs: dict | None = None
    ) -> None:
        self.sampled = sampled
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    def result(self) -> ModelRunnerOutput:
        return ModelRunnerOutput(
            sampled_token_ids=self.sampled.tolist(),
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
        )


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, source.hf_config, self.device)
        self.hf_config = source.hf_config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Memory that others (other processes, earlier engines in this one) hold before we start.
            free, total = torch.cuda.mem_get_info()
            self._memory_used_before = total - free
            self._allocated_before = torch.cuda.memory_allocated()
        with torch.device(self.device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = model_class(source.hf_config)(source.hf_config, max_model_len)
            finally:
                torch.set_default_dtype(default_dtype)
        if source.format == "dummy":
            self._init_dummy_weights()
        else:
            self.model.load_weights(source.iter_weights())
        self.model.eval()
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.max_blocks_per_seq = cdiv(max_model_len, self.block_size)
        self.input_batch = InputBatch(config.max_num_seqs, self.max_blocks_per_seq, self.block_size)
        self.decode_graphs: DecodeGraphs | None = None
        # cuDNN's dense prefill belongs to the fast path; the torch reference backend stays pure.
        self.dense_prefill_ok = self.device.type == "cuda" and get_kernels(self.device).backend == "triton"

    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs once the KV cache exists (the graphs bake in its addresses)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        self.decode_graphs = DecodeGraphs(
            self.model, self.config.max_num_seqs, self.max_blocks_per_seq, self.max_model_len, self.device
        )
        self.decode_graphs.capture()

    def _init_dummy_weights(self) -> None:
        generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)

    # ---- KV cache ---------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        layers = self.model.attention_layers()
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * element for a in layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        for attn in self.model.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            # Left uninitialised: attention uses only slots a request has written and masks (or zeroes)
            # the rest of its blocks, so zeroing gigabytes would buy nothing.
            attn.k_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.empty(shape, dtype=self.dtype, device=self.device)

    # ---- one step ---------------------------------------------------------------------------

    def to_device(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        def device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        md = AttentionMetadata(
            slot_mapping=device(inputs.slot_mapping),
            block_tables=device(inputs.block_tables),
            seq_lens=device(inputs.seq_lens),
            query_start_loc=device(inputs.query_start_loc),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            dense_prefill=(
                self.dense_prefill_ok
                and len(inputs.seq_lens) == 1
                and inputs.max_query_len == inputs.max_seq_len
            ),
        )
        return device(inputs.input_ids), device(inputs.positions), md

    def _sampling_batch(self, scheduler_output: SchedulerOutput, vocab_size: int) -> SamplingBatch:
        requests = [r for r, _ in scheduler_output.scheduled]
        params = [r.sampling_params for r in requests]
        generators = {}
        for row, (request, num_new) in enumerate(scheduler_output.scheduled):
            # A seeded request draws only for tokens it keeps, so chunking and batching never shift it.
            keeps_token = request.num_computed_tokens + num_new >= request.num_tokens
            seed = request.sampling_params.seed
            if keeps_token and seed is not None and not request.sampling_params.greedy:
                generator = self.generators.get(request.request_id)
                if generator is None:
                    generator = torch.Generator(device=self.device).manual_seed(seed)
                    self.generators[request.request_id] = generator
                generators[row] = generator
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in params]
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        # One host-to-device copy for all four per-row knobs (top-k fits fp32 exactly: vocab < 2**24).
        knobs = torch.tensor(
            [[0.0 if p.greedy else p.temperature for p in params], top_k, [p.top_p for p in params],
             [p.min_p for p in params]],
            dtype=torch.float32,
        ).to(self.device, non_blocking=True)  # fmt: skip
        return SamplingBatch(
            requests=requests,
            temperature=knobs[0],
            top_k=knobs[1].long(),
            top_p=knobs[2],
            min_p=knobs[3],
            all_greedy=all(p.greedy for p in params),
            needs_logit_edits=any(
                p.logit_bias or r.num_output_tokens < p.min_tokens for r, p in zip(requests, params)
            ),
            needs_top_k_p=any(k < vocab_size for k in top_k) or any(p.top_p < 1 for p in params),
            needs_min_p=any(p.min_p > 0 for p in params),
            needs_penalties=any(p.uses_penalties for p in params),
            generators=generators,
            max_num_logprobs=max(logprob_counts) if logprob_counts else -1,
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> PendingRunnerOutput:
        """Launch one step on the device; the returned output's result() waits for the tokens."""
        for request_id in scheduler_output.finished_req_ids:
            self.generators.pop(request_id, None)
        inputs = self.input_batch.prepare(scheduler_output)
        # Host-to-device copies from pageable memory wait for the stream, so every input goes over
        # before the forward pass is launched; after it, nothing waits until result().
        sampling_batch = self._sampling_batch(scheduler_output, self.hf_config.vocab_size)
        # Requests asking for prompt logprobs whose chunk still scores prompt tokens need every row's
        # hidden state, which only the eager path keeps.
        scoring = [
            (row, request, num_new)
            for row, (request, num_new) in enumerate(scheduler_output.scheduled)
            if request.sampling_params.prompt_logprobs is not None
            and request.num_computed_tokens + 1 < request.num_prompt_tokens
        ]
        prompt_logprobs = None
        if self.decode_graphs is not None and not scoring and self.decode_graphs.can_run(inputs):
            logits = self.decode_graphs.run(inputs)
        else:
            input_ids, positions, md = self.to_device(inputs)
            last_rows = torch.from_numpy(inputs.query_start_loc[1:].astype(np.int64) - 1).to(self.device)
            hidden = self.model(input_ids, positions, md)
            logits = self.model.compute_logits(hidden[last_rows])
            if scoring:
                prompt_logprobs = self._prompt_logprobs(hidden, inputs.query_start_loc, scoring)
        sampled, logprobs = self.sampler(logits, sampling_batch)
        return PendingRunnerOutput(sampled, logprobs, prompt_logprobs)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, query_start_loc: np.ndarray, scoring: list
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Score the prompt tokens this step's chunks predict: the row at position p scores token p + 1."""
        result = {}
        for row, request, num_new in scoring:
            start = request.num_computed_tokens
            num_scored = min(start + num_new, request.num_prompt_tokens - 1) - start
            first_row = int(query_start_loc[row])
            k = request.sampling_params.prompt_logprobs
            entries: list[TokenLogprobs] = []
            # Slices bound the [rows, vocab] fp32 buffer on long prompts.
            for offset in range(0, num_scored, _PROMPT_LOGPROB_ROWS):
                count = min(_PROMPT_LOGPROB_ROWS, num_scored - offset)
                rows = hidden[first_row + offset : first_row + offset + count]
                logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
                targets = request.all_token_ids[start + offset + 1 : start + offset + 1 + count]
                target_ids = torch.tensor(targets, dtype=torch.int64, device=self.device)
                entries += map(TokenLogprobs, *score_tokens(logprobs, target_ids, k))
            result[request.request_id] = (start + 1, entries)
        return result

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
        num_rows = min(num_tokens, self.config.max_num_seqs)
        self.model.compute_logits(hidden[-num_rows:]).float().softmax(dim=-1)
        torch.cuda.synchronize()
        # Weights plus the activation peak, this engine's own share of the allocator.
        peak = torch.cuda.max_memory_allocated() - self._allocated_before - scratch_bytes
        _, total = torch.cuda.mem_get_info()
        self.allocate_kv_cache(0)
        torch.cuda.empty_cache()
        # Headroom for the CUDA graphs' private pool and allocator fragmentation.
        reserve = 512 << 20
        return int(total * self.config.gpu_memory_utilization - self._memory_used_before - peak - reserve)
