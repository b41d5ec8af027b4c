"""Triton neox rotary against the torch reference, in place on strided views of a fused projection."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import reference, rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def cos_sin_cache(max_position: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE, dtype)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 48), (5, 5, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_in_place(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(0)
    num_tokens = 11
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    query, key = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    positions = torch.randint(0, 300, (num_tokens,), generator=gen).to(DEVICE)
    cache = cos_sin_cache(300, head_dim, torch.float32)
    want_q, want_k = reference.rotary_embedding(positions, query, key, cache)
    value_before = fused[:, num_heads + num_kv_heads :].clone()
    got_q, got_k = rotary.rotary_embedding(positions, query, key, cache)
    assert got_q.data_ptr() == query.data_ptr() and got_k.data_ptr() == key.data_ptr()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(fused[:, num_heads + num_kv_heads :], value_before)


def test_bf16_cache() -> None:
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(3, 2, 32, generator=gen).to(DEVICE)
    key = torch.randn(3, 1, 32, generator=gen).to(DEVICE)
    positions = torch.tensor([0, 5, 63], device=DEVICE)
    cache = cos_sin_cache(64, 32, torch.bfloat16)
    want_q, want_k = reference.rotary_embedding(positions, query, key, cache)
    got_q, got_k = rotary.rotary_embedding(positions, query.clone(), key.clone(), cache)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(6, 2, 48), (5, 5, 64)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_fused_rotary_and_kv_write_match_the_two_references(
    num_heads: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype
) -> None:
    """One launch: q and k rotated in place, the rotated k and v stored at their slots (with an FP8
    cache's scales), padding slots skipped; the same as rotary_embedding then write_kv_cache."""
    gen = torch.Generator().manual_seed(2)
    num_tokens, block_size, num_blocks = 9, 4, 6
    fused = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE)
    query, key = fused[:, :num_heads], fused[:, num_heads : num_heads + num_kv_heads]
    value = fused[:, num_heads + num_kv_heads :]
    positions = torch.randint(0, 300, (num_tokens,), generator=gen).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1  # a padding row
    slots = slots.to(DEVICE)
    cache = cos_sin_cache(300, head_dim, torch.float32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, device=DEVICE).to(cache_dtype) for _ in range(4)]
    scales = (0.5, 2.0) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    want_q, want_k = reference.rotary_and_write_kv_cache(
        positions, query.clone(), key.clone(), value, cache, caches[0], caches[1], slots, *scales
    )
    got_q, got_k = rotary.rotary_and_write_kv_cache(
        positions, query, key, value, cache, caches[2], caches[3], slots, *scales
    )
    assert got_q.data_ptr() == query.data_ptr() and got_k.data_ptr() == key.data_ptr()
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    # e4m3 rounding of a value that sits on a rounding boundary may differ by one step.
    tol = dict(atol=1e-5, rtol=1e-5) if cache_dtype == torch.float32 else dict(atol=0.0, rtol=0.07)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), **tol)
    torch.testing.assert_close(caches[3].float(), caches[1].float(), **tol)
