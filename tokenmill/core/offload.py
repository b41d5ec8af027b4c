"""The CPU tier of the prefix cache, as the scheduler keeps it: which host blocks hold which block
hashes, in LRU order. Ints only; the copies are the worker's (worker/kv_offload.py).

A full block evicted from the device's prefix cache is saved to a host block before its device block
is overwritten (the save rides in the step that reuses the block, ahead of its forward pass). A later
prompt whose prefix continues past the device's hits into host blocks gets device blocks for them,
loaded in its first step ahead of the forward pass, and computes only the rest. With the disk tier
(DiskBlockPool) a host block the CPU tier evicts is kept on disk, and read back into a host block when a
prefix continues there."""

from __future__ import annotations

from collections import OrderedDict


class _Slots:
    """Slots (host blocks, disk slots) holding block hashes, least recently used first; the slots a step
    in planning reads or fills are held until its record is drained."""

    def __init__(self, num_blocks: int, knob: str) -> None:
        if num_blocks < 1:
            raise ValueError(f"{knob} holds {num_blocks} KV blocks; give it room for at least one block")
        self.num_blocks = num_blocks
        self._by_hash: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self._in_use: set[int] = set()

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def touch(self, block_hash: int) -> None:
        self._by_hash.move_to_end(block_hash)

    def _claim(self, block_hash: int) -> int | None:
        """A slot for block_hash, held for this step: a free one, else the least recently used one not
        held (its block goes to _evicted); None when every slot is held."""
        slot = self._free.pop() if self._free else None
        if slot is None:
            for old_hash, old_slot in self._by_hash.items():
                if old_slot not in self._in_use:
                    del self._by_hash[old_hash]
                    self._evicted(old_hash, old_slot)
                    slot = old_slot
                    break
        if slot is None:
            return None
        self._by_hash[block_hash] = slot
        self._in_use.add(slot)
        return slot

    def _evicted(self, block_hash: int, slot: int) -> None:
        """The block in `slot` is dropped for another (before the slot is overwritten)."""

    def end_step(self) -> None:
        """The step's record is drained: its slots may be reused."""
        self._in_use.clear()

    def reset(self) -> None:
        self._by_hash.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))


class DiskBlockPool(_Slots):
    """The CPU tier's own second tier (kv_offload_disk): which disk slots hold which block hashes. A host
    block the CPU tier evicts is written to a slot ("spilled") before the host block is reused; a later
    prefix hit that continues on disk reads its slots back into host blocks first."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks, "kv_offload_disk_gib")
        self.num_spilled = 0
        self.num_read = 0

    def put(self, block_hash: int) -> int | None:
        """A slot to write block_hash to, or None: already on disk (now most recent) or no slot free."""
        if block_hash in self._by_hash:
            self.touch(block_hash)
            return None
        slot = self._claim(block_hash)
        if slot is not None:
            self.num_spilled += 1
        return slot

    def read(self, block_hash: int) -> int:
        slot = self._by_hash[block_hash]
        self.touch(block_hash)
        self._in_use.add(slot)
        self.num_read += 1
        return slot


class HostBlockPool(_Slots):
    def __init__(self, num_blocks: int, num_disk_blocks: int = 0) -> None:
        super().__init__(num_blocks, "kv_offload_gib")
        self.disk = DiskBlockPool(num_disk_blocks) if num_disk_blocks else None
        # With the disk tier, in the worker's order: host blocks written to disk slots before anything
        # overwrites them, then (after the saves) disk slots read into host blocks before the loads.
        self.spills: list[tuple[int, int]] = []  # (host block, disk slot)
        self.disk_reads: list[tuple[int, int]] = []  # (disk slot, host block)
        self.saves: list[tuple[int, int]] = []  # (device block, host block), in planning order
        self.loads: list[tuple[int, int]] = []  # (host block, device block)
        self.num_saved = 0  # cumulative blocks
        self.num_loaded = 0

    def save(self, device_block: int, block_hash: int) -> None:
        """A device block holding `block_hash` is being evicted: keep a copy unless the host has one."""
        if block_hash in self._by_hash:
            self.touch(block_hash)
            return
        host_block = self._claim(block_hash)
        if host_block is None:
            return  # every host block is in use by this step: the block is simply lost
        self.saves.append((device_block, host_block))
        self.num_saved += 1

    def hold(self, host_blocks: list[int]) -> None:
        """Keep these host blocks (a prefix hit about to be loaded) from being reused by this step."""
        self._in_use.update(host_blocks)

    def load(self, host_block: int, device_block: int) -> None:
        self._in_use.add(host_block)
        self.loads.append((host_block, device_block))
        self.num_loaded += 1

    def from_disk(self, block_hash: int) -> int | None:
        """A host block for a block found on disk, read there ahead of this step's loads; None when no host
        block is free for it."""
        assert self.disk is not None
        host_block = self._claim(block_hash)
        if host_block is not None:
            self.disk_reads.append((self.disk.read(block_hash), host_block))
        return host_block

    def _evicted(self, block_hash: int, slot: int) -> None:
        if self.disk is not None:
            disk_slot = self.disk.put(block_hash)
            if disk_slot is not None:
                self.spills.append((slot, disk_slot))

    def drain(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The saves and loads planned since the last drain, for the step's record (the disk tier's
        spills and reads: drain_disk, first)."""
        saves, loads = self.saves, self.loads
        self.saves, self.loads = [], []
        self.end_step()
        return saves, loads

    def drain_disk(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        spills, reads = self.spills, self.disk_reads
        self.spills, self.disk_reads = [], []
        if self.disk is not None:
            self.disk.end_step()
        return spills, reads

    def reset(self) -> None:
        super().reset()
        if self.disk is not None:
            self.disk.reset()
