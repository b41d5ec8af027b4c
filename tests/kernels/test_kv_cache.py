"""Triton KV-cache store against the torch reference: scattered slots, padding slots, strided inputs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import kv_cache, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(3, 48), (2, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_blocks, kv_block_size = 13, 5, 16
    # Key and value are views of a fused qkv projection, as the model hands them over.
    fused = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 3 * num_kv_heads :]
    slots = torch.randperm(num_blocks * kv_block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1
    slot_mapping = slots.to(DEVICE)
    k_cache = torch.randn(num_blocks, kv_block_size, num_kv_heads, head_dim, generator=gen)
    k_cache = k_cache.to(DEVICE, cache_dtype)
    v_cache = torch.randn_like(k_cache)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, want_k, want_v, slot_mapping)
    kv_cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


def test_int32_slot_mapping_and_no_tokens() -> None:
    k_cache = torch.zeros(2, 16, 1, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(2, 1, 16, device=DEVICE)
    kv_cache.write_kv_cache(
        key, 2 * key, k_cache, v_cache, torch.tensor([17, -1], dtype=torch.int32, device=DEVICE)
    )
    assert k_cache.sum().item() == 16 and k_cache[1, 1].eq(1).all()
    assert v_cache.sum().item() == 32 and v_cache[1, 1].eq(2).all()
    kv_cache.write_kv_cache(
        key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE)
    )
    assert k_cache.sum().item() == 16


@pytest.mark.parametrize("key_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_stores_scaled_and_saturated_values_like_the_reference(key_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_dim = 9, 3, 48
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 40).to(DEVICE, key_dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 3).to(DEVICE, key_dtype)
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 448.0 * 0.5, 0.0])  # past e4m3's range at k_scale 0.5
    slot_mapping = torch.tensor([5, 0, -1, 17, 31, 2, 8, 40, 63], device=DEVICE)
    caches = [
        torch.zeros(4, 16, num_kv_heads, head_dim, device=DEVICE, dtype=torch.float8_e4m3fn) for _ in range(4)
    ]
    reference.write_kv_cache(key, value, caches[0], caches[1], slot_mapping, 0.5, 0.05)
    kv_cache.write_kv_cache(key, value, caches[2], caches[3], slot_mapping, 0.5, 0.05)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    stored = caches[0].view(-1, num_kv_heads, head_dim)[5, 0, :4].float()
    assert stored.tolist() == [448.0, -448.0, 448.0, 0.0]  # saturated, never inf or NaN
    # Dequantized, a stored value is within e4m3's rounding of the original.
    back = caches[1].view(-1, num_kv_heads, head_dim)[slot_mapping[slot_mapping >= 0]].float() * 0.05
    original = value[slot_mapping >= 0].float()
    assert ((back - original).abs() <= original.abs() / 16 + 0.05 * 2**-10).all()
