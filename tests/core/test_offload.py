"""The CPU tier's accounting (core/offload.py with the KV cache manager): evicted cached blocks are
saved to host blocks, a prefix that continues past the device's hits into the host is loaded into new
device blocks, which become shareable at once; host blocks a step reads or fills are never reused within
it; the host LRU evicts."""

from __future__ import annotations

import pytest

from tokenmill.core.kv_cache import KVCacheManager
from tokenmill.core.offload import DiskBlockPool, HostBlockPool
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def prefill(
    kv: KVCacheManager, request_id: str, token_ids: list[int], cache_salt: str | None = None
) -> tuple[Request, list[int]]:
    """Admit and fully compute a prompt; returns the request and its host loads."""
    request = Request(request_id, token_ids, SamplingParams(max_tokens=1), cache_salt=cache_salt)
    hit = kv.get_computed_blocks(request)
    allocated = kv.allocate_slots(request, len(token_ids) - hit.num_tokens, hit.block_ids, hit.host_block_ids)
    assert allocated is not None
    request.num_computed_tokens = len(token_ids)
    kv.cache_full_blocks(request)
    return request, hit.host_block_ids


def test_evicted_blocks_go_to_the_host_and_come_back_as_a_prefix_hit() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=8)
    assert kv.host is not None
    a, _ = prefill(kv, "a", list(range(17)))  # 4 full blocks + 1
    a_full_blocks = a.block_ids[:4]
    kv.free(a)
    assert kv.host.drain() == ([], [])  # nothing evicted yet
    b, _ = prefill(kv, "b", list(range(100, 121)))  # 6 blocks: evicts a's 4 cached ones (and a's partial)
    saves, loads = kv.host.drain()
    assert sorted(d for d, _ in saves) == sorted(a_full_blocks)  # the partial block has no hash: not saved
    assert loads == [] and kv.host.num_saved == 4
    kv.free(b)
    # a again: its 4 full blocks are on the host only. The last token is always computed.
    again, host_hits = prefill(kv, "a2", list(range(17)))
    saves, loads = kv.host.drain()
    assert [h for h, _ in loads] == host_hits and len(loads) == 4
    assert [d for _, d in loads] == again.block_ids[:4]
    assert kv.offload_hits == 16 and kv.prefix_cache_hits == 0
    # b's blocks were evicted for the loads: saved first, in the same step's record.
    assert len(saves) >= 4
    # The loaded blocks are device-cached now: a third request shares them without a load.
    third, host_hits = prefill(kv, "a3", list(range(17)))
    assert host_hits == [] and third.block_ids[:4] == again.block_ids[:4]
    assert kv.prefix_cache_hits == 16


def test_host_blocks_in_use_by_a_step_are_not_reused_and_the_lru_evicts() -> None:
    host = HostBlockPool(2)
    host.save(10, hash("x"))
    host.save(11, hash("y"))
    host.save(12, hash("z"))  # both host blocks in use by this step: dropped
    assert host.lookup(hash("z")) is None and len(host.saves) == 2
    host.drain()
    host.touch(hash("x"))  # y is now the least recently used
    host.save(13, hash("z"))
    assert host.lookup(hash("y")) is None and host.lookup(hash("x")) is not None
    assert host.lookup(hash("z")) is not None
    host.save(14, hash("x"))  # already on the host: no copy
    assert host.drain()[0] == [(13, host.lookup(hash("z")))]
    with pytest.raises(ValueError, match="kv_offload_gib"):
        HostBlockPool(0)


def test_host_blocks_the_cpu_tier_evicts_spill_to_disk_and_come_back_through_it() -> None:
    """With the disk tier: a host block the CPU tier evicts is written to a disk slot (spilled, in the
    record before anything overwrites it); a prefix that continues on disk is read into host blocks
    (held from eviction meanwhile) and loaded from there like any host hit."""
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=4, num_disk_blocks=16)
    host = kv.host
    assert host is not None and host.disk is not None
    a, _ = prefill(kv, "a", list(range(17)))  # 4 full blocks
    kv.free(a)
    b, _ = prefill(kv, "b", list(range(100, 121)))  # evicts a's 4 blocks: saved to the 4 host blocks
    kv.free(b)
    assert host.drain_disk() == ([], [])
    assert len(host.drain()[0]) == 4
    c, _ = prefill(kv, "c", list(range(200, 221)))  # evicts b's cached blocks: the host is full, a spills
    saves, _ = host.drain()
    spills, reads = host.drain_disk()
    assert len(saves) == 4 and len(spills) == 4 and reads == []  # the host holds 4: a's go to disk
    # The same host blocks, overwritten by the saves after the spills.
    assert {h for h, _ in spills} == {h for _, h in saves}
    kv.free(c)
    # a again: its blocks are on disk only. They are read into host blocks, then loaded.
    again, host_hits = prefill(kv, "a2", list(range(17)))
    saves, loads = host.drain()
    spills, reads = host.drain_disk()
    assert len(reads) == 4 and [h for _, h in reads] == host_hits == [h for h, _ in loads]
    assert kv.disk_hits == 16 and kv.offload_hits == 16 and kv.prefix_cache_hits == 0
    assert host.disk.num_spilled >= 4 and host.disk.num_read == 4
    # The host blocks read into held b's blocks: those spill first (the worker runs spills before
    # reads), into slots other than the ones being read.
    assert {h for h, _ in spills} == set(host_hits)
    assert not {slot for _, slot in spills} & {slot for slot, _ in reads}
    with pytest.raises(ValueError, match="kv_offload_disk_gib"):
        DiskBlockPool(0)


def test_a_salted_prefix_in_the_host_and_disk_tiers_serves_only_its_own_salt() -> None:
    """cache_salt seeds the block hashes both tiers key by: a salted prompt evicted to the host, and
    then spilled to disk, is no hit for the same tokens unsalted or salted otherwise; its own salt loads
    it."""
    kv = KVCacheManager(num_blocks=6, block_size=4, num_host_blocks=4, num_disk_blocks=32)
    host = kv.host
    assert host is not None and host.disk is not None
    prompt = list(range(17))
    salted, _ = prefill(kv, "salted", prompt, "tenant-1")
    salted_hashes = salted.block_hashes[:4]
    kv.free(salted)
    # To the host, then to disk; each time other salts look it up (unsalted once on disk, where its own
    # blocks from an earlier lookup are not yet).
    for step, (filler, others) in enumerate(
        [(range(100, 121), ["tenant-2"]), (range(200, 221), [None, "tenant-3"])]
    ):
        kv.free(prefill(kv, f"filler{step}", list(filler))[0])
        host.drain()
        host.drain_disk()
        tier = host if step == 0 else host.disk
        assert all(tier.lookup(h) is not None for h in salted_hashes)
        for other in others:
            request, host_hits = prefill(kv, f"other{step}{other}", prompt, other)
            assert host_hits == [] and kv.offload_hits == 0
            kv.free(request)
            host.drain()
            host.drain_disk()
    assert all(host.disk.lookup(h) is not None for h in salted_hashes)
    _, host_hits = prefill(kv, "again", prompt, "tenant-1")
    assert len(host_hits) == 4 and kv.offload_hits == 16
