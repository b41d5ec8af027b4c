"""The CPU tier's copies (worker/kv_offload.py): blocks saved from caches of different shapes and dtypes
(a draft model's layers beside the target's, an FP8 cache) come back bit for bit into other device
blocks; saves run before loads in one call; runs of consecutive host blocks move in one copy."""

from __future__ import annotations

import types

import pytest
import torch

from tokenmill.worker.kv_offload import HostKVCache, _runs


def layer(num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype, device: str = "cpu"):
    def cache() -> torch.Tensor:
        return torch.randn(num_blocks, block_size, heads, dim).to(device=device, dtype=dtype)

    return types.SimpleNamespace(k_cache=cache(), v_cache=cache(), num_kv_heads=heads, head_dim=dim)


NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_saved_blocks_load_back_bit_for_bit(dtype, device) -> None:
    torch.manual_seed(0)
    shapes = ((2, 5), (1, 7), (3, 4))
    layers = [layer(11, 3, heads, dim, dtype, device) for heads, dim in shapes]
    host = HostKVCache(layers, num_blocks=6, device=torch.device(device))
    assert host.block_bytes == sum(
        2 * 3 * h * d * torch.empty((), dtype=dtype).element_size() for h, d in shapes
    )
    before = {
        (i, name): getattr(attn, name).clone()
        for i, attn in enumerate(layers)
        for name in ("k_cache", "v_cache")
    }
    host.transfer(saves=[(7, 4), (2, 0), (9, 1)], loads=[])
    # Overwrite the saved device blocks, then load them back into other blocks (and block 7 into itself,
    # in the call that saves block 3 first).
    for attn in layers:
        for name in ("k_cache", "v_cache"):
            getattr(attn, name)[[7, 2, 9]] = torch.zeros(3, *getattr(attn, name).shape[1:]).to(
                device=device, dtype=dtype
            )
    host.transfer(saves=[(3, 5)], loads=[(4, 7), (0, 10), (1, 8), (5, 0)])
    for i, attn in enumerate(layers):
        for name in ("k_cache", "v_cache"):
            now, old = getattr(attn, name).view(torch.uint8), before[i, name].view(torch.uint8)
            assert (
                torch.equal(now[7], old[7]) and torch.equal(now[10], old[2]) and torch.equal(now[8], old[9])
            )
            assert torch.equal(now[0], old[3])  # saved and loaded in one call: the save went first
    assert host.bytes_saved == 4 * host.block_bytes and host.bytes_loaded == 4 * host.block_bytes


def test_consecutive_host_blocks_are_one_copy() -> None:
    assert _runs([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]
    assert _runs([]) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_stream_copies_keep_their_order_when_a_stream_lags() -> None:
    """On a GPU the pool's copies run on a save stream and a load stream. Each stream is held up in turn
    (torch.cuda._sleep queued on it) while the other direction touches the same host row: the copy that
    came second must still see the first one's effect, and the step's stream must see the loaded block."""
    torch.manual_seed(0)
    layers = [layer(8, 4, 2, 64, torch.bfloat16, "cuda") for _ in range(3)]
    host = HostKVCache(layers, num_blocks=4, device=torch.device("cuda"))
    streams = host._streams
    assert streams is not None

    def block(device_block: int) -> list[torch.Tensor]:
        return [getattr(a, n)[device_block].clone() for a in layers for n in ("k_cache", "v_cache")]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    spin = 200_000_000  # GPU cycles: ~0.1 s, far longer than the host takes to issue what follows
    # A save held up on its stream, then a load of the same row: the load waits for the save.
    first = block(1)
    with torch.cuda.stream(streams.save):
        torch.cuda._sleep(spin)
    host.transfer(saves=[(1, 2)], loads=[])
    host.transfer(saves=[], loads=[(2, 5)])
    assert same(block(5), first)  # block() reads on the step's stream, after the loads' event
    # A load held up on its stream, then a save over the same row: the save waits for the load.
    second = block(3)
    with torch.cuda.stream(streams.load):
        torch.cuda._sleep(spin)
    host.transfer(saves=[], loads=[(2, 6)])
    host.transfer(saves=[(3, 2)], loads=[])
    assert same(block(6), first)
    host.transfer(saves=[], loads=[(2, 7)])
    assert same(block(7), second)
    # Copies that share no row do not wait for each other: a load runs while a save is held up.
    with torch.cuda.stream(streams.save):
        torch.cuda._sleep(spin * 5)
    host.transfer(saves=[(4, 0)], loads=[(2, 0)])
    loaded = torch.cuda.Event()
    loaded.record(torch.cuda.current_stream())
    loaded.synchronize()
    assert not streams.pending[-2][1].query()  # the save is still held up, the load is done
    assert same(block(0), second)
    torch.cuda.synchronize()
    assert host.bytes_saved == 3 * host.block_bytes and host.bytes_loaded == 4 * host.block_bytes
