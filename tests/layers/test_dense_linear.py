"""dense_linear: F.linear everywhere but one 16-bit row on a GPU against a weight wide enough to fill it,
which takes the one-row Triton kernel; the two agree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels import sm_count
from tokenmill.layers import dense


def test_off_the_gpu_it_is_f_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 64, generator=gen), torch.randn(4096, 64, generator=gen)
    bias = torch.randn(4096, generator=gen)
    assert torch.equal(dense.dense_linear(x, w, bias), F.linear(x, w, bias))
    assert torch.equal(dense.dense_linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_row_takes_the_gemv_and_matches_cublas(monkeypatch) -> None:
    pytest.importorskip("triton")
    from tokenmill.kernels import skinny_gemm

    calls = []

    def gemv(*args, **kwargs):
        calls.append(args)
        return skinny_gemm.dense_gemv(*args, **kwargs)

    real = dense.triton_kernel
    monkeypatch.setattr(
        dense, "triton_kernel", lambda module, name: gemv if name == "dense_gemv" else real(module, name)
    )
    device = torch.device("cuda")
    n = 16 * sm_count(device) + 40  # past a whole number of tiles
    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, 4104, device=device, dtype=torch.bfloat16, generator=gen) * 0.05
    bias = torch.randn(n, device=device, dtype=torch.bfloat16, generator=gen)
    x = torch.randn(1, 1, 4104, device=device, dtype=torch.bfloat16, generator=gen)
    got = dense.dense_linear(x, w, bias)
    assert len(calls) == 1 and got.shape == (1, 1, n)
    want = x.double() @ w.double().t() + bias.double()
    torch.testing.assert_close(got.double(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    # Two rows (skinny_gemm.DENSE_ROWS is 1), fp32, or a narrow weight stay on cuBLAS.
    dense.dense_linear(x.expand(2, 1, 4104), w)
    dense.dense_linear(x.float(), w.float())
    dense.dense_linear(x, w[: 8 * sm_count(device)])
    assert len(calls) == 1
