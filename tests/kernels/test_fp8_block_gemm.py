"""The Triton block-scaled FP8 GEMM against its reference on awkward shapes: rows and columns that do not
fill a tile or a scale block, scale blocks taller than a tile (through the interpreter on a CPU)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import quant_reference  # noqa: E402
from tokenmill.kernels.fp8_block_gemm import fp8_block_gemm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("m", "n", "k", "block_n", "block_k"),
    [(1, 64, 128, 128, 128), (5, 100, 96, 32, 32), (17, 200, 160, 128, 32), (70, 48, 64, 16, 64)],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference(m, n, k, block_n, block_k, out_dtype) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    a = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    a_scale = torch.rand(m, math.ceil(k / block_k), generator=gen) * 0.01
    w_scale = torch.rand(math.ceil(n / block_n), math.ceil(k / block_k), generator=gen) * 0.01
    args = [t.to(DEVICE) for t in (a, a_scale, w, w_scale)]
    got = fp8_block_gemm(*args, block_n, block_k, out_dtype)
    want = quant_reference.fp8_block_gemm(*[t.cpu() for t in args], block_n, block_k, torch.float64)
    assert got.shape == (m, n) and got.dtype == out_dtype
    tol = 1e-4 if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        got.cpu().double(), want.double(), atol=tol * want.abs().max().item(), rtol=tol
    )


def test_column_blocks_must_be_powers_of_two() -> None:
    a = torch.zeros(2, 48, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        fp8_block_gemm(
            a, torch.ones(2, 1, device=DEVICE), a, torch.ones(1, 1, device=DEVICE), 48, 48, torch.float32
        )
