"""An approximate map of which replica holds which prompt blocks: for each replica, the block hashes of
the prompts the router sent there, in LRU order, trimmed to the replica's KV capacity. The engine keeps
and evicts its prefix cache the same way (full blocks, LRU), so the map ages roughly as the caches do."""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, capacity_blocks: int = 1 << 20) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.default_capacity = capacity_blocks
        self._capacity: dict[str, int] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}  # block hash -> replicas that (probably) hold it

    def set_capacity(self, replica: str, capacity_blocks: int) -> None:
        """The replica's KV pool in blocks, when it reports one (its cache cannot hold more)."""
        self._capacity[replica] = max(1, capacity_blocks)
        self._trim(replica)

    def match(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """For each of `replicas`, how many of the leading blocks of `hashes` it holds in a row."""
        matched = dict.fromkeys(replicas, 0)
        candidates = set(replicas)
        for depth, block_hash in enumerate(hashes):
            candidates &= self._holders.get(block_hash, set())
            if not candidates:
                break
            for replica in candidates:
                matched[replica] = depth + 1
        return matched

    def record(self, replica: str, hashes: list[int]) -> None:
        """The replica is about to compute (and cache) these blocks: they become its most recent."""
        lru = self._lru.setdefault(replica, OrderedDict())
        for block_hash in hashes:
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = None
                self._holders.setdefault(block_hash, set()).add(replica)
        self._trim(replica)

    def drop(self, replica: str) -> None:
        """Forget the replica's blocks (it died or restarted with an empty cache)."""
        for block_hash in self._lru.pop(replica, ()):
            self._forget(block_hash, replica)

    def num_blocks(self, replica: str) -> int:
        return len(self._lru.get(replica, ()))

    def _trim(self, replica: str) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        capacity = self._capacity.get(replica, self.default_capacity)
        while len(lru) > capacity:
            block_hash, _ = lru.popitem(last=False)
            self._forget(block_hash, replica)

    def _forget(self, block_hash: int, replica: str) -> None:
        holders = self._holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[block_hash]
