"""CUDA graphs for decode and verify steps: one graph per batch size of a ladder, captured after warm-up
over static input buffers. A step of B requests replays the smallest graph of size >= B; its padding
requests have no query tokens (attention skips them) and its padding tokens slot -1 (their K/V are never
written).

Decode graphs take one query token per request. Verify graphs (speculative decoding) take up to
query_len = 1 + k per request, any mix of lengths up to that: their attention is the varlen kernel,
whose grid covers every layout of size * query_len tokens, and they return the logits of every token
row, since verification reads each draft's position."""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill import distributed
from tokenmill.layers.attention import AttentionMetadata
from tokenmill.worker.input_batch import StepInputs
from tokenmill.worker.piecewise_graphs import PiecewiseGraphs

if TYPE_CHECKING:
    from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")

# The largest step the piecewise graphs cover, in tokens.
PIECEWISE_MAX_TOKENS = 8192
# The largest batch whose verify steps replay a whole-step graph (larger ones use the piecewise graphs):
# speculation pays at small batches, and each graph keeps logits for all its token rows.
VERIFY_GRAPH_MAX_SEQS = 64


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, 1025, 32))
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        query_len: int = 1,
    ) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.query_len = query_len
        self.sizes = graph_batch_sizes(max_num_seqs)
        n = self.sizes[-1]
        tokens = n * query_len
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: size * self.query_len],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=self.query_len,
            # Fixes the split-KV grid for the graph; each split's length adapts to the real seq_len.
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        tokens = size * self.query_len
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], self._metadata(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        # Warm-up inputs: every request's query_len tokens at positions 0.. into no slot.
        q = self.query_len
        self.query_start_loc.copy_(torch.arange(self.query_start_loc.numel(), dtype=torch.int32) * q)
        self.seq_lens.fill_(q)
        for size in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            for _ in range(2):
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        for graph in self.graphs.values():
            graph.replay()  # the first launch uploads the graph: not on a request's path
        torch.cuda.synchronize()
        kind = "decode" if q == 1 else f"verify ({q} tokens a request)"
        logger.info("captured %d %s CUDA graphs for batch sizes %s", len(self.graphs), kind, self.sizes)

    def can_run(self, inputs: StepInputs) -> bool:
        if self.query_len == 1:
            return inputs.max_query_len == 1 and len(inputs.seq_lens) <= self.sizes[-1]
        return 1 < inputs.max_query_len <= self.query_len and len(inputs.seq_lens) <= self.sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this step (its inputs already on the device); returns logits [T, vocab],
        a row per token of the step (for a decode step, one per request)."""
        num_seqs = md.seq_lens.shape[0]
        num_tokens = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, num_seqs)]
        num_blocks = md.block_tables.shape[1]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(md.slot_mapping)
        self.seq_lens[:num_seqs].copy_(md.seq_lens)
        self.block_tables[:num_seqs, :num_blocks].copy_(md.block_tables)
        self.query_start_loc[: num_seqs + 1].copy_(md.query_start_loc)
        if size * self.query_len > num_tokens:
            self.slot_mapping[num_tokens : size * self.query_len].fill_(-1)
        if size > num_seqs:
            self.seq_lens[num_seqs:size].fill_(0)
            self.query_start_loc[num_seqs + 1 : size + 1].fill_(num_tokens)
        self.graphs[size].replay()
        return self.logits[size][:num_tokens]


def capture_step_graphs(
    runner: ModelRunner, max_num_batched_tokens: int
) -> tuple[DecodeGraphs | None, DecodeGraphs | None, PiecewiseGraphs | None]:
    """The runner's graphs (decode, verify, piecewise), captured once its KV cache exists (the graphs
    bake in its addresses); None where a kind does not apply: no graphs off CUDA, with enforce_eager,
    for the pooling runner (it never decodes), for a model whose shapes depend on the data, or under
    tensor parallelism (graphs around NCCL's collectives are not captured yet)."""
    config = runner.config
    if runner.device.type != "cuda" or config.enforce_eager or runner.pooling_type is not None:
        return None, None, None
    if not getattr(runner.model, "graph_safe", True) or distributed.tp_size() > 1:
        return None, None, None
    # Imported here: kernels' Triton modules load only once a device (or the tests' interpreter setting)
    # is known.
    from tokenmill.kernels import pdl

    # The graphs' kernels (and the warm-ups that build them) launch with PDL; eager steps' do not.
    with pdl.in_graphs():
        decode = DecodeGraphs(
            runner.model, config.max_num_seqs, runner.max_blocks_per_seq, runner.max_model_len, runner.device
        )
        decode.capture()
        verify = None
        spec = config.speculative_config
        if spec is not None:
            # Verify steps of up to VERIFY_GRAPH_MAX_SEQS requests, each with its drafts and one token more.
            max_seqs = min(config.max_num_seqs, VERIFY_GRAPH_MAX_SEQS)
            if spec.disable_by_batch_size is not None:
                max_seqs = min(max_seqs, spec.disable_by_batch_size)
            verify = DecodeGraphs(
                runner.model, max_seqs, runner.max_blocks_per_seq, runner.max_model_len, runner.device,
                query_len=1 + spec.num_speculative_tokens,
            )  # fmt: skip
            verify.capture()
        piecewise = None
        if runner.model.kernels.backend == "triton":
            # Larger steps are device-bound: their launches hide behind the arithmetic.
            piecewise = PiecewiseGraphs(
                runner.model, min(max_num_batched_tokens, PIECEWISE_MAX_TOKENS), runner.device
            )
            piecewise.capture()
    return decode, verify, piecewise
