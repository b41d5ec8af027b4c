"""The CPU tier of the prefix cache, as the scheduler keeps it: which host blocks hold which block
hashes, in LRU order. Ints only; the copies are the worker's (worker/kv_offload.py).

A full block evicted from the device's prefix cache is saved to a host block before its device block
is overwritten (the save rides in the step that reuses the block, ahead of its forward pass). A later
prompt whose prefix continues past the device's hits into host blocks gets device blocks for them,
loaded in its first step ahead of the forward pass, and computes only the rest."""

from __future__ import annotations

from collections import OrderedDict


class HostBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(
                f"kv_offload_gib holds {num_blocks} KV blocks; give it room for at least one block"
            )
        self.num_blocks = num_blocks
        # block hash -> host block, least recently used first.
        self._by_hash: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        # Host blocks a step in planning reads (a load) or fills (a save): never evicted before the
        # step's record is drained.
        self._in_use: set[int] = set()
        self.saves: list[tuple[int, int]] = []  # (device block, host block), in planning order
        self.loads: list[tuple[int, int]] = []  # (host block, device block)
        self.num_saved = 0  # cumulative blocks
        self.num_loaded = 0

    def lookup(self, block_hash: int) -> int | None:
        return self._by_hash.get(block_hash)

    def save(self, device_block: int, block_hash: int) -> None:
        """A device block holding `block_hash` is being evicted: keep a copy unless the host has one."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return
        host_block = self._take()
        if host_block is None:
            return  # every host block is in use by this step: the block is simply lost
        self._by_hash[block_hash] = host_block
        self._in_use.add(host_block)
        self.saves.append((device_block, host_block))
        self.num_saved += 1

    def hold(self, host_blocks: list[int]) -> None:
        """Keep these host blocks (a prefix hit about to be loaded) from being reused by this step."""
        self._in_use.update(host_blocks)

    def load(self, host_block: int, device_block: int) -> None:
        self._in_use.add(host_block)
        self.loads.append((host_block, device_block))
        self.num_loaded += 1

    def touch(self, block_hash: int) -> None:
        self._by_hash.move_to_end(block_hash)

    def drain(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The saves and loads planned since the last drain, for the step's record."""
        saves, loads = self.saves, self.loads
        self.saves, self.loads = [], []
        self._in_use.clear()
        return saves, loads

    def reset(self) -> None:
        self._by_hash.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def _take(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, host_block in self._by_hash.items():
            if host_block not in self._in_use:
                del self._by_hash[block_hash]
                return host_block
        return None
