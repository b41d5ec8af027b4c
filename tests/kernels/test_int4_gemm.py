"""The Triton W4A16 GEMM and the whole-weight dequantization against dequantize-then-matmul on awkward
shapes: groups that do not divide K, zero points, split K, leading dims, bias (through the interpreter on
a CPU); and which kernel the INT4 linears' GEMM takes at each batch size."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import int4_gemm, skinny_gemm, w4a16_gemv_cuda, w4a16_mma  # noqa: E402
from tokenmill.kernels.int4_gemm import dequantize, w4a16_dequant_gemm, w4a16_gemm, w4a16_linear  # noqa: E402
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


@pytest.mark.parametrize(
    ("n", "k", "group", "zeros"), [(37, 200, 64, True), (16, 256, 128, False), (5, 24, 8, True)]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_matches_the_reference(n, k, group, zeros, dtype) -> None:
    packed, scale, zero = make_weight(n, k, group, zeros, seed=n + k)
    got = dequantize(packed, scale, zero, group, k, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    torch.testing.assert_close(got, dequantize_int4(packed, scale, zero, group, k, dtype), atol=0, rtol=0)


def test_dequant_gemm_with_bias_and_leading_dims() -> None:
    packed, scale, zero = make_weight(24, 256, 128, True, seed=3)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 40, 256, generator=gen).to(DEVICE, torch.bfloat16)
    bias = torch.randn(24, generator=gen).to(DEVICE, torch.bfloat16)
    got = w4a16_dequant_gemm(x, packed, scale, zero, 128, bias)
    want = x.double() @ dequantize_int4(packed, scale, zero, 128, 256, torch.float64).t() + bias.double()
    assert got.shape == (2, 40, 24) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize(
    ("rows", "group", "kernel"),
    [
        (1, 128, "w4a16_skinny"),
        (2, 128, "w4a16_skinny"),  # up to skinny_gemm.GEMV4_ROWS rows: the packed-fp16 one-row kernel
        (3, 128, "w4a16_mma"),
        (int4_gemm.MMA_ROWS, 128, "w4a16_mma"),
        (int4_gemm.DEQUANT_ROWS, 128, "w4a16_dequant_gemm"),
        (3, 64, "w4a16_skinny"),  # groups under 128 values: not the tensor-core kernel
        (int4_gemm.DEQUANT_ROWS + 7, 64, "w4a16_dequant_gemm"),
    ],
)
def test_linear_takes_the_kernel_for_its_rows(monkeypatch, rows, group, kernel) -> None:
    """The Triton kernels' bounds (the tensor-core GEMV off: test_w4a16_gemv_cuda routes to it)."""
    monkeypatch.setattr(w4a16_gemv_cuda, "MMA_GEMV", False)
    taken = []
    for module, name in [(skinny_gemm, "w4a16_skinny"), (w4a16_mma, "w4a16_mma"), (int4_gemm, "w4a16_gemm"),
                         (int4_gemm, "w4a16_dequant_gemm")]:  # fmt: skip
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            taken.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    packed, scale, zero = make_weight(20, 256, group, True, seed=rows)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(DEVICE, torch.bfloat16)
    got = w4a16_linear(x, packed, scale, zero, group)
    assert taken == [kernel]
    want = x.double() @ dequantize_int4(packed, scale, zero, group, 256, torch.float64).t()
    torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_fp32_activations_past_the_skinny_rows_take_the_tiled_kernel(monkeypatch) -> None:
    taken = []
    real = int4_gemm.w4a16_gemm
    monkeypatch.setattr(int4_gemm, "w4a16_gemm", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    packed, scale, zero = make_weight(20, 256, 128, False, seed=5)
    x = torch.randn(int4_gemm.DEQUANT_ROWS, 256).to(DEVICE)
    w4a16_linear(x, packed, scale, zero, 128)
    assert taken == [1]
