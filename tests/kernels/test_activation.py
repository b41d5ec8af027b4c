"""Triton SiLU-and-multiply against the torch reference, rounding included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import activation, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("shape", [(7, 2 * 300), (2, 3, 2 * 1100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    got = activation.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-6, rtol=8e-3)
    torch.testing.assert_close(got, want, **tol)


def test_strided_rows() -> None:
    wide = torch.randn(5, 900, device=DEVICE)
    x = wide[:, 100:700]
    torch.testing.assert_close(activation.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-5)
