"""The attention layer's dense prefill path (cuDNN SDPA on a GPU) against the paged reference."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.reference import paged_attention
from tokenmill.layers.attention import dense_causal_attention

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    [(37, 6, 2, 48), (300, 32, 8, 128), (256, 4, 4, 64), (4097, 4, 1, 64)],
)
def test_dense_prefill_matches_paged_reference(device, num_tokens, num_heads, num_kv_heads, head_dim):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(num_tokens, heads, head_dim, generator=generator).to(device, dtype)
        for heads in (num_heads, num_kv_heads, num_kv_heads)
    )
    # One request whose context is exactly this step's tokens, stored one token per block.
    k_cache, v_cache = k[:, None].contiguous(), v[:, None].contiguous()
    expected = paged_attention(
        q.float(), k_cache.float(), v_cache.float(),
        torch.arange(num_tokens, dtype=torch.int32, device=device)[None],
        torch.tensor([num_tokens], dtype=torch.int32, device=device),
        torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        head_dim**-0.5,
    )  # fmt: skip
    got = dense_causal_attention(q, k, v, head_dim**-0.5)
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    assert got.shape == q.shape  # padded to its bucket inside, cut back outside
    torch.testing.assert_close(got.float(), expected, **tolerance)


def test_dense_buckets_cover_every_length_with_few_plans():
    from tokenmill.layers.attention import dense_bucket

    buckets = {dense_bucket(n) for n in range(1, 8193)}
    assert len(buckets) == 20 and all(dense_bucket(n) >= n for n in range(1, 8193))
    assert dense_bucket(256) == 256 and dense_bucket(257) == 512 and dense_bucket(4097) == 5120
