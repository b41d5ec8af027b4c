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
