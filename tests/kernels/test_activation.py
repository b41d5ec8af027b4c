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


@pytest.mark.parametrize(("num_rows", "intermediate"), [(2, 14336 // 4), (1, 200), (3, 1056)])
def test_silu_and_mul_also_writes_the_4bit_gemvs_activation_pairs(num_rows, intermediate) -> None:
    """silu_and_mul_packed: the plain launch's output, and the same rows packed for the down projection's
    4-bit one-row GEMV with pack_activations' bits (its sums in another order), across programs."""
    from tokenmill.kernels.gemv_packed_x import pack_activations

    gen = torch.Generator().manual_seed(intermediate)
    x = (torch.randn(num_rows, 2 * intermediate, generator=gen) * 3).to(DEVICE, torch.bfloat16)
    out, packed = activation.silu_and_mul_packed(x)
    assert torch.equal(out, activation.silu_and_mul(x))
    want = pack_activations(out)
    assert torch.equal(packed.pairs, want.pairs) and torch.equal(packed.down, want.down)
    torch.testing.assert_close(packed.sums, want.sums, rtol=1e-5, atol=1e-3)
