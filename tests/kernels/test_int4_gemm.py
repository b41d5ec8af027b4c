"""The Triton W4A16 GEMM against dequantize-then-matmul on awkward shapes: groups that do not divide K,
zero points, split K, leading dims, bias (through the interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels.int4_gemm import w4a16_gemm  # noqa: E402
from tokenmill.kernels.quant_reference import dequantize_int4, pack_int4  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_weight(n: int, k: int, group: int, zeros: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=gen, dtype=torch.int8)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=gen) * 0.1 + 0.01
    zero = torch.randint(-3, 4, (n, groups), generator=gen, dtype=torch.int8) if zeros else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(pack_int4(q)), to(scale), to(zero)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "split_k"),
    [
        (1, 64, 128, 32, False, None),
        (3, 72, 96, 32, True, None),
        (17, 40, 200, 64, True, 1),  # K not a multiple of the group or of the tile
        (5, 130, 256, 128, False, 4),  # split K: partial sums meet in fp32
        (33, 96, 64, 16, True, 2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_dequantize_then_matmul(m, n, k, group, zeros, split_k, dtype) -> None:
    packed, scale, zero = make_weight(n, k, group, zeros, seed=m * n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    got = w4a16_gemm(x, packed, scale, zero, group, bias, split_k=split_k)
    weight = dequantize_int4(packed, scale, zero, group, k, torch.float64)
    want = x.double() @ weight.t() + bias.double()
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_leading_dims_and_empty_batch() -> None:
    packed, scale, _ = make_weight(64, 64, 32, False, seed=1)
    x = torch.randn(2, 3, 64).to(DEVICE)
    got = w4a16_gemm(x, packed, scale, None, 32)
    torch.testing.assert_close(got.reshape(6, 64), w4a16_gemm(x.reshape(6, 64), packed, scale, None, 32))
    assert w4a16_gemm(x[:0, 0], packed, scale, None, 32).shape == (0, 64)
