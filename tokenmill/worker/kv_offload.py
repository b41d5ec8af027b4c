"""The CPU tier's tensors and copies (the scheduler's side is core/offload.py): for every attention
layer a host K and V pool shaped like the device cache ([host blocks, block size, KV heads, head dim];
pinned on a GPU), and the step's saves and loads, run ahead of its forward pass on the step's stream.

A save gathers the evicted device blocks of each layer into one tensor and copies it to pinned memory
without waiting; the host scatter into the pool happens once the copy is done (at a later step, or
before any load, which reads the pool). A load gathers host blocks into pinned memory, copies them to
the device without waiting and scatters them into the cache there: the forward pass that follows on the
same stream reads them."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch


class _PendingSave(NamedTuple):
    done: torch.cuda.Event
    host_index: torch.Tensor
    staged: list[torch.Tensor]  # pinned, one per pool tensor, in pool order


class HostKVCache:
    def __init__(
        self, attention_layers: list, num_blocks: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.layers = attention_layers
        self.num_blocks = num_blocks
        self.device = device
        self.cuda = device.type == "cuda"
        # FP8 caches move as bytes: index_select and index_copy do not take float8 everywhere.
        self.dtype = torch.uint8 if dtype.itemsize == 1 else dtype
        self.pools: list[torch.Tensor] = []
        for attn in attention_layers:
            shape = (num_blocks, attn.k_cache.shape[1], attn.num_kv_heads, attn.head_dim)
            for _ in ("k", "v"):
                self.pools.append(torch.empty(shape, dtype=self.dtype, pin_memory=self.cuda))
        self.block_bytes = sum(p[0].numel() * p.element_size() for p in self.pools)
        self._pending: list[_PendingSave] = []
        self.bytes_saved = 0
        self.bytes_loaded = 0
        self.host_seconds = 0.0  # time the host spent issuing copies and scattering

    def _caches(self) -> list[torch.Tensor]:
        return [cache.view(self.dtype) for attn in self.layers for cache in (attn.k_cache, attn.v_cache)]

    def transfer(self, saves: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        start = time.perf_counter()
        self._finish_saves(wait=False)
        if saves:
            self._save(saves)
        if loads:
            self._finish_saves(wait=True)  # a load may read a host block a save is still filling
            self._load(loads)
        self.host_seconds += time.perf_counter() - start

    def _save(self, saves: list[tuple[int, int]]) -> None:
        device_index = torch.tensor([d for d, _ in saves], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        host_index = torch.tensor([h for _, h in saves], dtype=torch.int64)
        self.bytes_saved += len(saves) * self.block_bytes
        if not self.cuda:
            for pool, cache in zip(self.pools, self._caches(), strict=True):
                pool.index_copy_(0, host_index, cache.index_select(0, device_index))
            return
        staged = []
        for cache in self._caches():
            out = torch.empty((len(saves), *cache.shape[1:]), dtype=cache.dtype, pin_memory=True)
            out.copy_(cache.index_select(0, device_index), non_blocking=True)
            staged.append(out)
        done = torch.cuda.Event()
        done.record()
        self._pending.append(_PendingSave(done, host_index, staged))

    def _finish_saves(self, wait: bool) -> None:
        """Scatter saves whose copies have landed into the pool, in order (a later save may reuse a
        host block an earlier one filled)."""
        while self._pending and (wait or self._pending[0].done.query()):
            pending = self._pending.pop(0)
            pending.done.synchronize()
            for pool, staged in zip(self.pools, pending.staged, strict=True):
                pool.index_copy_(0, pending.host_index, staged)

    def _load(self, loads: list[tuple[int, int]]) -> None:
        host_index = torch.tensor([h for h, _ in loads], dtype=torch.int64)
        device_index = torch.tensor([d for _, d in loads], dtype=torch.int64).to(
            self.device, non_blocking=True
        )
        self.bytes_loaded += len(loads) * self.block_bytes
        for pool, cache in zip(self.pools, self._caches(), strict=True):
            if not self.cuda:
                cache.index_copy_(0, device_index, pool.index_select(0, host_index))
                continue
            staged = torch.empty((len(loads), *pool.shape[1:]), dtype=pool.dtype, pin_memory=True)
            torch.index_select(pool, 0, host_index, out=staged)
            # The caching host allocator keeps `staged` until this copy is done.
            cache.index_copy_(0, device_index, staged.to(self.device, non_blocking=True))
