"""The skinny GEMM (decode linears at small batch) against torch's matmul in fp32, on awkward sizes:
rows 1..16, feature counts that are not multiples of the tiles, strided inputs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import skinny_gemm  # noqa: E402
from tokenmill.kernels.skinny_gemm import SkinnyConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(DEVICE, dtype)
    return x, w


def expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).to(x.dtype)


@pytest.mark.parametrize("m,n,k", [(1, 48, 512), (3, 37, 300), (16, 100, 256), (7, 16, 17), (2, 5, 1000)])
def test_fp32_matches_matmul(m: int, n: int, k: int) -> None:
    x, w = operands(m, n, k, torch.float32)
    config = SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=2)
    torch.testing.assert_close(skinny_gemm.skinny_gemm(x, w, config), expected(x, w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 5])
def test_bf16_matches_matmul_within_rounding(m: int) -> None:
    x, w = operands(m, 80, 384, torch.bfloat16, seed=1)
    got = skinny_gemm.skinny_gemm(x, w, SkinnyConfig(block_n=32, block_k=128, num_warps=4, num_stages=2))
    # fp32 accumulation, one rounding to bf16 at the end: within a bf16 unit of the exact product.
    torch.testing.assert_close(got.float(), expected(x.float(), w.float()), atol=2e-2, rtol=8e-3)


def test_strided_rows_and_too_many_rows() -> None:
    x, w = operands(4, 40, 160, torch.float32, seed=2)
    wide = torch.zeros(4, 400, device=DEVICE)
    wide[:, 7:167] = x
    strided = wide[:, 7:167]
    config = SkinnyConfig(block_n=16, block_k=64, num_warps=4, num_stages=2)
    got = skinny_gemm.skinny_gemm(strided, w, config)
    torch.testing.assert_close(got, expected(x, w), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="at most 16 rows"):
        skinny_gemm.skinny_gemm(torch.zeros(17, 160, device=DEVICE), w)
    with pytest.raises(ValueError, match="features"):
        skinny_gemm.skinny_gemm(torch.zeros(2, 161, device=DEVICE), w)
