"""Piecewise CUDA graphs for steps that carry prompt tokens: the model between attention layers is
captured once per token-count bucket, and attention, whose work depends on every request's context,
runs eagerly between the pieces with the step's own metadata.

A step with prompt tokens launched eagerly pays the host for every kernel of every layer (and cuBLAS
picks a kernel for each new token count): on an H200 host a Qwen3-0.6B step with 2,048 prompt tokens
beside 252 decodes took ~40 ms of wall time for ~12 ms of device work, and every stream in the batch
waited that long for its next token. Replayed, the same step costs one graph launch per layer plus the
attention launches.

Capture runs the model once per bucket with each Attention layer set to split: the graph being captured
ends at the attention call (after copying q, k and v into static buffers), and the next piece's graph
begins, reading the attention output from a static buffer. Replay is the list of pieces with one eager
attention call after each but the last. Every piece of every bucket shares one memory pool; the pieces
are replayed in the order they were captured, which is what makes that sharing safe. Buckets are
captured largest first, so smaller ones reuse its memory.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from tokenmill.layers.attention import Attention, AttentionMetadata

logger = logging.getLogger("tokenmill")


def piecewise_sizes(max_num_tokens: int) -> list[int]:
    """Token-count buckets: fine where padding would cost most relative to the step, coarser above."""
    sizes = [16, 32, 64, 128, 192] + list(range(256, 2049, 128)) + list(range(2304, 8193, 256))
    return [s for s in sizes if s < max_num_tokens] + [max_num_tokens]


class PiecewiseGraphs:
    def __init__(self, model: nn.Module, max_num_tokens: int, device: torch.device) -> None:
        self.model = model
        self.sizes = piecewise_sizes(max_num_tokens)
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        n = self.sizes[-1]
        first = self.layers[0]
        dtype = next(model.parameters()).dtype
        q_size, kv_size = first.num_heads * first.head_dim, first.num_kv_heads * first.head_dim
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        # Shared by every layer in turn: a piece writes q/k/v here, attention reads them and writes out.
        self.q = torch.zeros(n, first.num_heads, first.head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, first.num_kv_heads, first.head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n, first.num_kv_heads, first.head_dim, dtype=dtype, device=device)
        self.out = torch.zeros(n, q_size, dtype=dtype, device=device)
        assert all(
            m.num_heads * m.head_dim == q_size and m.num_kv_heads * m.head_dim == kv_size for m in self.layers
        )
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture: _Capture | None = None

    # ---- capture ------------------------------------------------------------------------------

    def _split(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention.forward while capturing: end this piece at the attention call, start the next."""
        size = q.shape[0]
        for buffer, tensor in ((self.q, q), (self.k, k), (self.v, v)):
            buffer[:size].view(size, -1).copy_(tensor.reshape(size, -1))
        if self._capture is not None:
            self._capture.next_piece()
        return self.out[:size]

    def _forward(self, size: int) -> torch.Tensor:
        # Attention never runs inside a piece, so the metadata is only a placeholder.
        md = AttentionMetadata(
            slot_mapping=self.input_ids[:size],
            block_tables=self.input_ids[:1, None],
            seq_lens=self.input_ids[:1],
            query_start_loc=self.input_ids[:2],
            max_query_len=size,
            max_seq_len=size,
        )
        return self.model(self.input_ids[:size], self.positions[:size], md)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        for layer in self.layers:
            layer.split = self._split
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for size in reversed(self.sizes):
                    self._forward(size)  # warm-up: cuBLAS and Triton pick and build their kernels
                    torch.cuda.synchronize()
                    self._capture = _Capture(self.pool)
                    self.hidden[size] = self._forward(size)
                    self.pieces[size] = self._capture.finish()
                    self._capture = None
            torch.cuda.current_stream().wait_stream(stream)
            # A graph's first launch uploads it to the device (milliseconds for a piece of a large
            # model): pay that here, not on the first request of each size. The pieces compute on the
            # static buffers' stale contents, which nothing reads.
            for pieces in self.pieces.values():
                for piece in pieces:
                    piece.replay()
            torch.cuda.synchronize()
        finally:
            self._capture = None
            for layer in self.layers:
                layer.split = None
        logger.info(
            "captured piecewise CUDA graphs for %d token counts up to %d (%d pieces each) in %.1f s",
            len(self.sizes), self.sizes[-1], len(self.layers) + 1, time.perf_counter() - start,
        )  # fmt: skip

    # ---- replay -------------------------------------------------------------------------------

    def can_run(self, num_tokens: int, md: AttentionMetadata) -> bool:
        return num_tokens <= self.sizes[-1] and not md.dense_prefill

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [num_tokens, hidden_size] (before the LM head)."""
        num_tokens = input_ids.shape[0]
        size = self.sizes[bisect.bisect_left(self.sizes, num_tokens)]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        if size > num_tokens:  # padding rows: token 0 at position 0, computed and never read
            self.input_ids[num_tokens:size].zero_()
            self.positions[num_tokens:size].zero_()
        q, k, v, out = self.q[:num_tokens], self.k[:num_tokens], self.v[:num_tokens], self.out[:num_tokens]
        pieces = self.pieces[size]
        for piece, layer in zip(pieces, self.layers, strict=False):
            piece.replay()
            layer.attend(q, k, v, md, out=out.view(q.shape), positions=self.positions[:num_tokens])
        pieces[-1].replay()
        return self.hidden[size][:num_tokens]


class _Capture:
    """The pieces of one bucket's capture, on the current (side) stream and one shared pool."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self._begin()

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def next_piece(self) -> None:
        self.graphs[-1].capture_end()
        self._begin()

    def finish(self) -> list[torch.cuda.CUDAGraph]:
        self.graphs[-1].capture_end()
        return self.graphs
