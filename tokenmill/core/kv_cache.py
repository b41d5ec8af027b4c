"""KV cache manager: which blocks each request holds, prefix-cache lookups, and when full blocks become
shareable. Pure accounting over block ids; the tensors live in the worker."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.offload import HostBlockPool
from tokenmill.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(cache_salt: str | None) -> int:
    """The parent hash of a request's first block; a salt isolates one tenant's cache from another's."""
    if not cache_salt:
        return 0
    return int.from_bytes(hashlib.sha256(cache_salt.encode()).digest()[:8], "little")


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    # Tuples of ints hash the same in every process (no string hash randomisation involved).
    return hash((parent_hash, token_ids))


class PrefixHit(NamedTuple):
    """A new request's cached prefix: device blocks it shares, then host blocks to load into new ones."""

    block_ids: list[int]
    num_tokens: int  # tokens the two hold together
    host_block_ids: list[int]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
    ) -> None:
        """num_host_blocks: the CPU tier of the prefix cache (0: none; needs prefix caching);
        num_disk_blocks: its second tier on disk (0: none)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found on the device
        self.offload_hits = 0  # tokens found in the host tier (loaded, not computed)
        self.disk_hits = 0  # of which read back from its disk tier first
        self.host: HostBlockPool | None = None
        if num_host_blocks and enable_prefix_caching:
            self.host = HostBlockPool(num_host_blocks, num_disk_blocks)
            self.pool.on_evict = self.host.save

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        for i in range(len(hashes), num_tokens // bs):
            parent = hash_block(parent, tuple(tokens[i * bs : (i + 1) * bs]))
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest cached prefix of a new request: device blocks, then (with the host tier) host
        blocks that continue it.

        At least the last token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, [])
        max_hit_tokens = request.num_tokens - 1
        self._update_block_hashes(request, max_hit_tokens)
        hashes = request.block_hashes[: max_hit_tokens // self.block_size]
        block_ids: list[int] = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        host_block_ids: list[int] = []
        if self.host is not None:
            for block_hash in hashes[len(block_ids) :]:
                host_block = self.host.lookup(block_hash)
                if host_block is None:
                    break
                host_block_ids.append(host_block)
            disk = self.host.disk
            if disk is not None:
                # The prefix continues on disk: those blocks come back into host blocks now (read ahead
                # of this step's loads), so the request loads them as it loads any host hit. The host
                # hits above are held first: taking host blocks for the reads must not evict them.
                self.host.hold(host_block_ids)
                for block_hash in hashes[len(block_ids) + len(host_block_ids) :]:
                    if disk.lookup(block_hash) is None:
                        break
                    host_block = self.host.from_disk(block_hash)
                    if host_block is None:
                        break
                    host_block_ids.append(host_block)
                    self.disk_hits += self.block_size
        num_device_tokens = len(block_ids) * self.block_size
        num_host_tokens = len(host_block_ids) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_device_tokens
        self.offload_hits += num_host_tokens
        return PrefixHit(block_ids, num_device_tokens + num_host_tokens, host_block_ids)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: list[int] | None = None,
        host_block_ids: list[int] | None = None,
    ) -> list[int] | None:
        """Make room for num_new_tokens more tokens after the computed ones (a new request's prefix hit:
        shared device blocks, and host blocks loaded into the first of the new ones).

        Returns the block ids newly allocated (empty when the request's blocks already hold the slots),
        or None when blocks run out.
        """
        if (
            not computed_block_ids
            and not host_block_ids
            and (request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size)
        ):
            return []  # the common decode step: its slot is in a block the request already holds
        computed_block_ids = computed_block_ids or []
        host_block_ids = host_block_ids or []
        num_hit_blocks = len(computed_block_ids) + len(host_block_ids)
        num_tokens_after = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        num_needed = (
            cdiv(num_tokens_after, self.block_size) - len(request.block_ids) - len(computed_block_ids)
        )
        # Cached blocks that sit in the free queue stop being allocatable once this request takes them.
        num_reclaimed = sum(1 for b in computed_block_ids if self.pool.blocks[b].ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return None
        if computed_block_ids:
            self.pool.touch(computed_block_ids)
            request.block_ids.extend(computed_block_ids)
            request.num_cached_blocks = len(request.block_ids)
        if host_block_ids:
            assert self.host is not None
            self.host.hold(host_block_ids)  # the allocation's evictions must not reuse them
        new_block_ids = self.pool.allocate(num_needed) if num_needed > 0 else []
        request.block_ids.extend(new_block_ids)
        if host_block_ids:
            assert self.host is not None
            first = request.num_cached_blocks
            for offset, host_block in enumerate(host_block_ids):
                device_block = request.block_ids[first + offset]
                self.host.load(host_block, device_block)
                self.host.touch(request.block_hashes[first + offset])
                # Loaded ahead of the step's forward pass: shareable from this step on.
                self.pool.cache_block(device_block, request.block_hashes[first + offset])
            request.num_cached_blocks = first + len(host_block_ids)
        return new_block_ids

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are now full and computed, so later requests can share them.

        Only tokens already known count: a placeholder for a token still being sampled has no hash yet.
        A block whose KV a step in flight is still writing is safe to share, since every later step
        runs after it on the device.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        self._update_block_hashes(request, num_full * self.block_size)
        for i in range(request.num_cached_blocks, num_full):
            self.pool.cache_block(request.block_ids[i], request.block_hashes[i])
        request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.reset()
        return True
