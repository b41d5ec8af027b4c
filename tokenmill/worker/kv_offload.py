"""Moving KV blocks off and onto the device: BlockRows, the one layout a block takes outside the cache
(every attention layer's K and V of one block, as bytes, back to back), and the CPU tier's pool of such
rows (the scheduler's side is core/offload.py). Disaggregation ships the same rows between instances
(core/kv_transfer.py, serving/kv_transfer.py).

The host pool holds whole rows (pinned on a GPU), so a block crosses PCIe in one contiguous copy at full
bandwidth, and runs of consecutive host blocks in one. A save gathers the evicted device blocks of every
layer into a device staging tensor of the row layout and copies its rows into the pool; a load copies
pool rows into a staging tensor and scatters them into each layer's cache. Both run ahead of the step's
forward pass on the step's stream and never wait for the device: the pool is only ever read and written
by copies on that stream, in order."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.worker.device import on_device


class BlockRows:
    """The row layout of a block: every attention layer's K then V of one block, as bytes, back to back.
    Gathers device blocks into rows and scatters rows into device blocks, on the caller's stream."""

    def __init__(self, attention_layers: list, device: torch.device) -> None:
        self.layers = attention_layers
        self.device = device
        self.spans: list[tuple[int, int]] = []  # each cache tensor's (byte offset, bytes) in a row
        offset = 0
        for cache in self.caches():
            self.spans.append((offset, cache[0].numel()))
            offset += cache[0].numel()
        self.block_bytes = offset

    def caches(self) -> list[torch.Tensor]:
        """Every cache tensor as bytes ([blocks, block size, KV heads, head dim x element size]): rows
        move bytes, whatever the KV dtype (FP8 included)."""
        return [cache.view(torch.uint8) for attn in self.layers for cache in (attn.k_cache, attn.v_cache)]

    def _share(self, rows: torch.Tensor, index: int, cache: torch.Tensor) -> torch.Tensor:
        offset, size = self.spans[index]
        return rows[:, offset : offset + size].view(rows.shape[0], *cache.shape[1:])

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        """[len(block_ids), block_bytes] on the device."""
        index = on_device(block_ids, torch.int64, self.device)
        rows = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8, device=self.device)
        for i, cache in enumerate(self.caches()):
            self._share(rows, i, cache).copy_(cache.index_select(0, index))
        return rows

    def scatter(self, rows: torch.Tensor, block_ids: list[int]) -> None:
        """rows [len(block_ids), block_bytes] on the device into those blocks."""
        index = on_device(block_ids, torch.int64, self.device)
        for i, cache in enumerate(self.caches()):
            cache.index_copy_(0, index, self._share(rows, i, cache))

    def export(self, block_ids: list[int]) -> bytes:
        """The blocks' KV as bytes (rows in order), for another engine of the same model and layout."""
        return self.gather(block_ids).cpu().numpy().tobytes()

    def import_(self, block_ids: list[int], data: bytes) -> None:
        if len(data) != len(block_ids) * self.block_bytes:
            raise ValueError(
                f"received {len(data)} bytes of KV for {len(block_ids)} blocks of {self.block_bytes}: "
                "the peer runs another model, dtype or block size"
            )
        rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(block_ids), self.block_bytes)
        self.scatter(rows.to(self.device), block_ids)


class HostKVCache:
    def __init__(
        self,
        attention_layers: list,
        num_blocks: int,
        device: torch.device,
        disk_dir: str | None = None,
        num_disk_blocks: int = 0,
    ) -> None:
        """disk_dir, num_disk_blocks: the disk tier, one file of num_disk_blocks rows in disk_dir (an
        unlinked temporary file: nothing is left behind at exit)."""
        self.rows = BlockRows(attention_layers, device)
        self.num_blocks = num_blocks
        self.device = device
        self.block_bytes = self.rows.block_bytes
        self.pool = torch.empty(
            (num_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=device.type == "cuda"
        )
        self.disk = None
        if disk_dir is not None and num_disk_blocks:
            # Rows written into a memory map go to the page cache at memcpy speed; the kernel writes them
            # out in the background.
            self._disk_file = tempfile.TemporaryFile(dir=disk_dir, prefix="tokenmill-kv-")  # noqa: SIM115 (the cache's life)
            self.disk = np.memmap(
                self._disk_file, dtype=np.uint8, mode="w+", shape=(num_disk_blocks, self.block_bytes)
            )
        # The last copies issued between the pool and the device: host-side reads and writes of pool rows
        # (the disk tier's) wait for them.
        self._copied: torch.cuda.Event | None = None
        self.bytes_saved = 0
        self.bytes_loaded = 0
        self.bytes_spilled = 0
        self.bytes_read = 0
        self.host_seconds = 0.0  # time the host spent issuing the copies

    def transfer(
        self,
        saves: list[tuple[int, int]],
        loads: list[tuple[int, int]],
        spills: Sequence[tuple[int, int]] = (),
        disk_reads: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Spills first (host rows to disk, before anything overwrites them), then saves (a device block
        saved here may be the target of one of the loads), then disk reads into host rows, then loads."""
        start = time.perf_counter()
        if spills or disk_reads:
            if self._copied is not None:
                self._copied.synchronize()  # recorded a step ago, at the start of its forward pass
            assert self.disk is not None
            pool = self.pool.numpy()
            for host_block, slot in spills:
                self.disk[slot] = pool[host_block]
            self.bytes_spilled += len(spills) * self.block_bytes
        if saves:
            staging = self.rows.gather([d for d, _ in saves])
            for first, host_first, count in _runs([h for _, h in saves]):
                self.pool[host_first : host_first + count].copy_(
                    staging[first : first + count], non_blocking=True
                )
            self.bytes_saved += len(saves) * self.block_bytes
        if disk_reads:
            # Into host rows no copy in flight touches: the saves above write other rows (a host block is
            # taken once a step), and the earlier steps' copies are done (the wait above).
            for slot, host_block in disk_reads:
                pool[host_block] = self.disk[slot]
            self.bytes_read += len(disk_reads) * self.block_bytes
        if loads:
            staging = torch.empty((len(loads), self.block_bytes), dtype=torch.uint8, device=self.device)
            for first, host_first, count in _runs([h for h, _ in loads]):
                staging[first : first + count].copy_(
                    self.pool[host_first : host_first + count], non_blocking=True
                )
            self.rows.scatter(staging, [d for _, d in loads])
            self.bytes_loaded += len(loads) * self.block_bytes
        if self.disk is not None and (saves or loads) and self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.host_seconds += time.perf_counter() - start


def _runs(host_blocks: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive host blocks as (position in the list, first host block, count): one copy each."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(host_blocks):
        if runs and runs[-1][1] + runs[-1][2] == block:
            first, host_first, count = runs[-1]
            runs[-1] = (first, host_first, count + 1)
        else:
            runs.append((position, block, 1))
    return runs
