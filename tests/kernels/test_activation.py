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


def _row_quant(int8: bool, static: float | None):
    from tokenmill.kernels import RowQuant
    from tokenmill.kernels.fp8_quant import quantize_fp8_per_row, quantize_int8_per_row

    scale = None if static is None else torch.tensor([static], device=DEVICE)
    return RowQuant(int8, scale, quantize_int8_per_row if int8 else quantize_fp8_per_row)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("static", [None, 0.03])
@pytest.mark.parametrize(("shape", "block"), [((7, 2 * 300), None), ((2, 3, 2 * 1100), 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_launch_writes_the_separate_launches_bits(shape, block, int8, static, dtype, monkeypatch):
    """silu_and_mul_quant against silu_and_mul then the per-row quantizer: the same values and scales,
    with the row in one block of registers and (block 256) in two passes over blocks of it; a static
    scale that saturates the large rows."""
    if block is not None:
        monkeypatch.setattr(activation, "_QUANT_BLOCK", block)
    gen = torch.Generator().manual_seed(len(shape) + int8)
    x = (4 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    x[0, ..., 5] = 0.0  # a zero product among the others
    quant = _row_quant(int8, static)
    got = activation.silu_and_mul_quant(x, quant)
    want_values, want_scale = quant.quantize(
        activation.silu_and_mul(x).reshape(-1, shape[-1] // 2), quant.static_scale
    )
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert got.values.dtype == want_values.dtype and torch.equal(got.scale, want_scale)
    assert torch.equal(got.values.view(torch.uint8), want_values.view(torch.uint8))


def test_quantizing_launch_of_no_rows() -> None:
    got = activation.silu_and_mul_quant(torch.empty(0, 64, device=DEVICE), _row_quant(False, None))
    assert got.values.shape == (0, 32) and got.scale.shape == (0, 1)


@pytest.mark.parametrize(("intermediate", "block"), [(300, None), (1000, 256), (200, None)])
def test_quantizing_launch_by_groups_writes_the_block_quantizers_bits(intermediate, block, monkeypatch):
    """Groups of 128 columns each at their own scale (fine-grained FP8's activations): in one block, over
    blocks of 256 (two groups each), and a row narrower than two groups."""
    from tokenmill.layers.quantization.fp8_block import fp8_block_row_quant

    if block is not None:
        monkeypatch.setattr(activation, "_QUANT_BLOCK", block)
    gen = torch.Generator().manual_seed(intermediate)
    x = (4 * torch.randn(3, 2 * intermediate, generator=gen)).to(DEVICE, torch.bfloat16)
    quant = fp8_block_row_quant(128)
    got = activation.silu_and_mul_quant(x, quant)
    want_values, want_scale = quant.quantize(activation.silu_and_mul(x), None)
    assert got.scale.shape == (3, -(-intermediate // 128)) and torch.equal(got.scale, want_scale)
    assert torch.equal(got.values.view(torch.uint8), want_values.view(torch.uint8))
