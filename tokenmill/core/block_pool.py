"""The block pool: every KV block's ref count and hash, the LRU queue of free blocks, and the map from
block hash to cached block. Freed blocks keep their contents and hash until they are reused."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the first is the least recently freed.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        # Told of each cached block about to be overwritten (block id, hash): the offload tier saves it.
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_queue):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self.free_queue)} free")
        block_ids = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                # Evict: the block's old contents are about to be overwritten.
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                    if self.on_evict is not None:
                        self.on_evict(block.block_id, block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            block_ids.append(block.block_id)
        return block_ids

    def lookup(self, block_hash: int) -> int | None:
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling free ones out of the queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the tail of the LRU queue.

        Callers pass a request's blocks in reverse so that its last blocks, the least likely to be
        shared, are evicted first.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block_id] = block

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block under its hash (the first holder of a hash wins)."""
        if not self.enable_caching:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True
