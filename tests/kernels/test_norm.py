"""Triton RMSNorm and fused residual-add RMSNorm against the torch reference, rounding included."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import norm, reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)


@pytest.mark.parametrize("shape", [(7, 100), (5, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = rows(shape, dtype, 0)
    weight = rows(shape[-1:], dtype, 1)
    got = norm.rms_norm(x, weight, EPS)
    want = reference.rms_norm(x, weight, EPS)
    assert got.dtype == want.dtype and got.shape == want.shape
    # rsqrt may differ in its last fp32 bit, which can move a bf16 result by one unit.
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 8e-3)


def test_rms_norm_fp32_weight_on_bf16_input_promotes_like_torch() -> None:
    x = rows((4, 96), torch.bfloat16, 2)
    weight = rows((96,), torch.float32, 3)
    got = norm.rms_norm(x, weight, EPS)
    want = reference.rms_norm(x, weight, EPS)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=8e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    x, residual = rows((9, 80), dtype, 4), rows((9, 80), dtype, 5)
    weight = rows((80,), dtype, 6)
    x_before, residual_before = x.clone(), residual.clone()
    got, got_residual = norm.fused_add_rms_norm(x, residual, weight, EPS)
    want, want_residual = reference.fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(got_residual, want_residual)  # one rounding of the sum, exactly as torch's add
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 8e-3)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    assert norm.rms_norm(x, torch.ones(64, device=DEVICE), EPS).shape == (0, 64)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("static", [None, 0.05])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("shape", "dtype"), [((7, 100), torch.bfloat16), ((2, 3, 48), torch.float32)])
def test_quantizing_norm_writes_the_separate_launches_bits(shape, dtype, with_residual, int8, static) -> None:
    """rms_norm_quant against the norm launch then the per-row quantizer (kernels/fp8_quant.py): the
    same quantized values, scales and new residual; a static scale that saturates the large rows."""
    from tokenmill.kernels import RowQuant
    from tokenmill.kernels.fp8_quant import quantize_fp8_per_row, quantize_int8_per_row

    x, residual = rows(shape, dtype, 7), rows(shape, dtype, 8) if with_residual else None
    weight = rows(shape[-1:], dtype, 9)
    quantize = quantize_int8_per_row if int8 else quantize_fp8_per_row
    quant = RowQuant(int8, None if static is None else torch.tensor([static], device=DEVICE), quantize)
    got, got_residual = norm.rms_norm_quant(x, residual, weight, EPS, quant)
    if residual is None:
        normed, want_residual = norm.rms_norm(x, weight, EPS), None
    else:
        normed, want_residual = norm.fused_add_rms_norm(x, residual, weight, EPS)
    want_values, want_scale = quantize(normed.reshape(-1, shape[-1]), quant.static_scale)
    assert got.shape == x.shape and got.dtype == normed.dtype and torch.equal(got.scale, want_scale)
    assert torch.equal(got.values.view(torch.uint8), want_values.view(torch.uint8))
    assert (got_residual is None) == (residual is None)
    if residual is not None:
        assert torch.equal(got_residual, want_residual)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("hidden", "group"), [(300, 128), (256, 64), (100, 128)])
def test_quantizing_norm_by_groups_writes_the_block_quantizers_bits(hidden, group, with_residual) -> None:
    """Each `group` columns of a row at their own scale (fine-grained FP8's activations,
    fp8_block.quantize_per_token_group): a ragged last group, and a row narrower than one group."""
    from tokenmill.layers.quantization.fp8_block import fp8_block_row_quant

    x, residual = rows((5, hidden), torch.bfloat16, 10), rows((5, hidden), torch.bfloat16, 11)
    weight = rows((hidden,), torch.bfloat16, 12)
    quant = fp8_block_row_quant(group)
    got, _ = norm.rms_norm_quant(x, residual if with_residual else None, weight, EPS, quant)
    normed = (
        norm.fused_add_rms_norm(x, residual, weight, EPS)[0]
        if with_residual
        else norm.rms_norm(x, weight, EPS)
    )
    want_values, want_scale = quant.quantize(normed, None)
    assert got.scale.shape == (5, -(-hidden // group)) and torch.equal(got.scale, want_scale)
    assert torch.equal(got.values.view(torch.uint8), want_values.view(torch.uint8))
