"""Moving KV blocks off and onto the device: BlockRows, the one layout a block takes outside the cache
(every attention layer's K and V of one block, as bytes, back to back), and the CPU tier's pool of such
rows (the scheduler's side is core/offload.py). Disaggregation ships the same rows between instances
(core/kv_transfer.py, serving/kv_transfer.py).

The host pool holds whole rows (pinned on a GPU), so a block crosses PCIe in one contiguous copy at full
bandwidth, and runs of consecutive host blocks in one. A save gathers the evicted device blocks of every
layer into a device staging tensor of the row layout and copies its rows into the pool; a load copies
pool rows into a staging tensor and scatters them into each layer's cache. The gathers and scatters run
ahead of the step's forward pass on the step's stream; on a GPU the PCIe copies run on two side streams
(one each way), so a load's copy starts when the host issues it, while the step before still computes,
and a save's copy overlaps the step's own forward pass. The step's stream waits only for its loads'
copies, on the device. A copy that touches a pool row another direction's copy still uses waits for
it (a row saved in this step or the last and loaded now; a row being loaded and now saved over)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator, Sequence

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
        self._streams = _SideStreams(device) if device.type == "cuda" else None
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
        streams = self._streams
        if spills or disk_reads:
            if streams is not None:
                streams.drain()  # host-side reads and writes of pool rows: no copy may be in flight
            assert self.disk is not None
            pool = self.pool.numpy()
            for host_block, slot in spills:
                self.disk[slot] = pool[host_block]
            self.bytes_spilled += len(spills) * self.block_bytes
        if saves:
            staging = self.rows.gather([d for d, _ in saves])
            host_blocks = [h for _, h in saves]
            with streams.saving(staging, host_blocks) if streams else contextlib.nullcontext():
                for first, host_first, count in _runs(host_blocks):
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
            shape = (len(loads), self.block_bytes)
            host_blocks = [h for h, _ in loads]
            copies: contextlib.AbstractContextManager[torch.Tensor]
            if streams:
                copies = streams.loading(shape, host_blocks)
            else:  # on the CPU the pool is the device's own memory: a plain tensor stages the rows
                copies = contextlib.nullcontext(torch.empty(shape, dtype=torch.uint8))
            with copies as staging:
                for first, host_first, count in _runs(host_blocks):
                    staging[first : first + count].copy_(
                        self.pool[host_first : host_first + count], non_blocking=True
                    )
            self.rows.scatter(staging, [d for _, d in loads])
            self.bytes_loaded += len(loads) * self.block_bytes
        self.host_seconds += time.perf_counter() - start


class _SideStreams:
    """The pool's copies on their own CUDA streams, one each way, and what orders them: the rows each
    direction's copies in flight touch, with an event recorded after them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.save = torch.cuda.Stream(device)
        self.load = torch.cuda.Stream(device)
        self.pending: list[tuple[str, torch.cuda.Event, frozenset[int]]] = []  # (direction, done, rows)

    def _wait_for(self, stream: torch.cuda.Stream, direction: str, rows: frozenset[int]) -> None:
        """stream waits for the other direction's copies in flight that touch any of rows."""
        self.pending = [p for p in self.pending if not p[1].query()]
        for other, done, touched in self.pending:
            if other != direction and not rows.isdisjoint(touched):
                stream.wait_event(done)

    @contextlib.contextmanager
    def saving(self, staging: torch.Tensor, host_blocks: list[int]) -> Iterator[None]:
        """Device-to-host copies of staging (gathered on the current stream) into host_blocks."""
        rows = frozenset(host_blocks)
        self.save.wait_stream(torch.cuda.current_stream(self.device))  # the gather into staging
        self._wait_for(self.save, "save", rows)  # rows a load still reads
        staging.record_stream(self.save)  # its memory is not reused until the copies are done
        with torch.cuda.stream(self.save):
            yield
            done = torch.cuda.Event()
            done.record()
        self.pending.append(("save", done, rows))

    @contextlib.contextmanager
    def loading(self, shape: tuple[int, int], host_blocks: list[int]) -> Iterator[torch.Tensor]:
        """Host-to-device copies from host_blocks into the staging tensor yielded (made on the load
        stream); the current stream waits for them before it goes on (to the scatter)."""
        rows = frozenset(host_blocks)
        self._wait_for(self.load, "load", rows)  # rows a save still writes
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.load):
            staging = torch.empty(shape, dtype=torch.uint8, device=self.device)
            yield staging
            done = torch.cuda.Event()
            done.record()
        main.wait_event(done)
        staging.record_stream(main)  # the scatter reads it there
        self.pending.append(("load", done, rows))

    def drain(self) -> None:
        for _, done, _ in self.pending:
            done.synchronize()
        self.pending.clear()


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
