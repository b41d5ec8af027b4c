"""The Triton per-row FP8 quantization against its torch reference: the same bytes and scales on
awkward row lengths (one block, several blocks, a ragged last block), zero rows and bf16 input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import quant_reference  # noqa: E402
from tokenmill.kernels.fp8_quant import quantize_fp8_per_row  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("rows", "columns"), [(1, 5), (7, 100), (3, 4096), (2, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_reference_bit_for_bit(rows: int, columns: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * columns)
    x = (torch.randn(rows, columns, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(DEVICE, dtype)
    if rows > 2:
        x[1] = 0.0  # stays zero, with the smallest scale
    q, scale = quantize_fp8_per_row(x)
    want_q, want_scale = quant_reference.quantize_fp8_per_row(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_static_scale_matches_the_reference(dtype: torch.dtype) -> None:
    """A checkpoint's per-tensor input scale: every row at it, values past 448 steps saturated."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 900, generator=gen) * torch.logspace(-1, 2, 5)[:, None]).to(DEVICE, dtype)
    static = torch.tensor([0.02], device=DEVICE)
    q, scale = quantize_fp8_per_row(x, static)
    want_q, want_scale = quant_reference.quantize_fp8_per_row(x, static)
    assert torch.equal(scale, want_scale) and scale.shape == (5, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert q.float().abs().max() == 448.0  # the large rows saturate


def test_strided_rows_and_no_rows() -> None:
    x = torch.randn(4, 64, device=DEVICE)[:, :48]
    q, scale = quantize_fp8_per_row(x)
    assert torch.equal(q.view(torch.uint8), quant_reference.quantize_fp8_per_row(x)[0].view(torch.uint8))
    assert quantize_fp8_per_row(x[:0])[0].shape == (0, 48)


@pytest.mark.parametrize(("rows", "columns"), [(1, 5), (7, 100), (3, 4096), (2, 5000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matches_the_reference_bit_for_bit(rows: int, columns: int, dtype: torch.dtype) -> None:
    """The int8 launch against layers/quantization/int8.py's torch reference, with ties planted at
    half steps (round half to even: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2) and a row's largest value at
    127.5 steps (clamped to 127)."""
    from tokenmill.kernels.fp8_quant import quantize_int8_per_row
    from tokenmill.layers.quantization.int8 import quantize_int8_reference

    gen = torch.Generator().manual_seed(rows * columns + 1)
    x = torch.randn(rows, columns, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    if rows > 2:
        x[1] = 0.0
    step = 0.25  # a power of two: x / scale lands on the planted halves exactly
    x[0] = (x[0] / x[0].abs().max() * 127.0).round() * step
    x[0, :5] = torch.tensor([0.5, 1.5, -2.5, 3.5, -127.5]) * step
    x = x.to(dtype)
    q, scale = quantize_int8_per_row(x.to(DEVICE))
    # The reference on the CPU, where torch divides by 127.5 (CUDA's torch multiplies by its reciprocal,
    # an ulp off at times; the kernel divides as the CPU does).
    want_q, want_scale = quantize_int8_reference(x)
    assert q.dtype == torch.int8 and scale.shape == (rows, 1)
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0)
    assert torch.equal(q.cpu(), want_q)
    assert q[0, :5].tolist() == [0, 2, -2, 4, -128]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_static_scale_saturates_as_the_reference(dtype: torch.dtype) -> None:
    """A checkpoint's per-tensor input scale: every row at it, values past 127 steps clamped."""
    from tokenmill.kernels.fp8_quant import quantize_int8_per_row
    from tokenmill.layers.quantization.int8 import quantize_int8_reference

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 1100, generator=gen) * torch.logspace(-1, 1, 6)[:, None]).to(dtype)
    static = torch.tensor([0.03])
    q, scale = quantize_int8_per_row(x.to(DEVICE), static.to(DEVICE))
    want_q, want_scale = quantize_int8_reference(x, static)
    assert torch.equal(scale.cpu(), want_scale) and scale.shape == (6, 1)
    assert torch.equal(q.cpu(), want_q)
    assert q.max() == 127 and q.min() == -128  # the large rows saturate
