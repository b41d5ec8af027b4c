"""The Triton row-wise-scaled FP8 GEMM against dequantize-then-matmul on awkward shapes: rows and columns
that do not fill a tile, K not a multiple of the tile, bias, the default tiles (through the interpreter
on a CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.fp8_gemm import Fp8GemmConfig, fp8_rowwise_gemm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 64, 128, Fp8GemmConfig(16, 32, 64, 4, 2)),
        (17, 100, 96, Fp8GemmConfig(16, 32, 32, 4, 2)),  # rows and columns past a tile
        (70, 48, 200, Fp8GemmConfig(32, 16, 64, 4, 3)),  # K not a multiple of the tile
        (40, 130, 256, None),  # the default tiles
    ],
)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("operands", ["e4m3", "int8"])  # int8: INT8 checkpoints' W8A8
def test_matches_dequantize_then_matmul(m, n, k, config, out_dtype, with_bias, operands) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    if operands == "int8":
        a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        a = (torch.randn(m, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        w = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    a_scale = torch.rand(m, 1, generator=gen) * 0.01 + 1e-3
    w_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
    bias = torch.randn(n, generator=gen) if with_bias else None
    want = (a.double() * a_scale.double()) @ (w.double() * w_scale.double()).t()
    if bias is not None:
        want = want + bias.double()
    args = [t.to(DEVICE) for t in (a, a_scale, w, w_scale)]
    got = fp8_rowwise_gemm(*args, bias.to(DEVICE, out_dtype) if with_bias else None, out_dtype, config)
    assert got.shape == (m, n) and got.dtype == out_dtype
    # On a GPU the products go through FP8 tensor cores, whose partial sums keep fewer bits than fp32.
    tol = (1e-3 if DEVICE.type == "cuda" else 1e-4) if out_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().double(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_empty_batch_and_strides() -> None:
    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn, device=DEVICE)
    ones = torch.ones(32, 1, device=DEVICE)
    assert fp8_rowwise_gemm(w[:0], ones[:0], w, ones, None, torch.float32).shape == (0, 32)
    with pytest.raises(ValueError, match="unit stride"):
        fp8_rowwise_gemm(w.t(), ones, w, ones, None, torch.float32)
