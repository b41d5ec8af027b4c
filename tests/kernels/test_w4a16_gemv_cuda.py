"""The tensor-core INT4 GEMV (kernels/w4a16_gemv_mma.cu) against dequantize-then-matmul in fp64 on awkward
shapes (rows 1-8, N not a multiple of its 16-row tiles, zero points, groups past 128 and per channel,
fp16 and bf16, fp32 and 16-bit scales, SiLU-and-multiply in the store, strided activations, PDL inside a
CUDA graph), which shapes it takes and how the INT4 linears route to it. On a CPU with NVRTC installed every
variant is compiled for sm_80 and sm_90 and checked for spills; the numerics need a GPU (`-m gpu`)."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import GemvFusion, activation, cuda_rtc, int4_gemm, pdl, w4a16_gemv_cuda  # noqa: E402
from tokenmill.kernels.quant_reference import dequantize_int4  # noqa: E402
from tokenmill.kernels.w4a16_gemv_cuda import MmaConfig, supports, w4a16_gemv_mma  # noqa: E402

from .test_int4_gemm import make_weight  # noqa: E402

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def weight(n, k, group, zeros, scale_dtype, seed):
    packed, scale, zero = make_weight(n, k, group, zeros, seed)
    return packed.cuda(), scale.to("cuda", scale_dtype), None if zero is None else zero.cuda()


def reference(x, packed, scale, zero, group):
    w = dequantize_int4(packed, scale, zero, group, x.shape[-1], torch.float64)
    return x.double() @ w.t()


def assert_close(got, want):
    tol = 1e-2
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.skipif(not cuda_rtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("arch", [80, 90])
def test_every_variant_compiles_without_spills(arch) -> None:
    source = w4a16_gemv_cuda.SOURCE.read_text()
    configs = itertools.cycle([(4, 1, 4), (8, 1, 2), (2, 2, 8), (4, 2, 3), (16, 1, 6)])
    for (bf16, scale, zero, gated), (warps, tiles, stages) in zip(
        itertools.product((0, 1), (0, 1, 2), (0, 1), (0, 1)), configs
    ):
        lean = (bf16 + scale + zero + gated) % 2  # half the variants each way, every flag met by both
        unroll = 1 + (bf16 + scale + gated) % 2
        defines = dict(BF16=bf16, SCALE=scale, HAS_ZERO=zero, GATED=gated, WARPS=warps, TILES=tiles,
                       STAGES=stages, LEAN=lean, UNROLL=unroll)  # fmt: skip
        cubin, log = cuda_rtc.compile_cubin(source, "w4a16_gemv_mma", arch, defines, verbose=True)
        assert cubin[:4] == b"\x7fELF", defines
        assert "0 bytes spill stores" in log and "0 bytes spill loads" in log, (defines, log)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros"),
    [
        (1, 64, 128, 128, False),
        (1, 200, 1024, 128, True),  # N not a multiple of 16
        (2, 96, 640, 128, False),  # chunks not a multiple of the warps
        (3, 48, 2048, 256, True),  # groups of two chunks
        (5, 40, 768, 768, False),  # one group a row (per channel)
        (8, 136, 4096, 128, True),
        (7, 24, 14336, 128, False),  # down's K: the long unroll
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_dtype", [None, torch.float32])
@pytest.mark.parametrize(("lean", "unroll"), [(False, 1), (True, 1), (False, 2), (True, 2)])
def test_matches_dequantize_then_matmul(m, n, k, group, zeros, dtype, scale_dtype, lean, unroll) -> None:
    packed, scale, zero = weight(n, k, group, zeros, scale_dtype or dtype, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to("cuda", dtype)
    assert supports(x, packed, scale, zero, group)
    got = w4a16_gemv_mma(x, packed, scale, zero, group, lean=lean, unroll=unroll)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_close(got, reference(x, packed, scale, zero, group))


CONFIGS = [
    MmaConfig(4, 2, 3),
    MmaConfig(16, 1, 2),
    MmaConfig(8, 2, 8),
    MmaConfig(2, 1, 6),
    MmaConfig(1, 1, 4),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize("unroll", [1, 2])
def test_every_config_gives_the_same_sums(config, lean, unroll) -> None:
    """(2,304 values: 18 chunks, so a warp's count of chunks is odd under some configs: the unrolled
    loop's remainder.)"""
    packed, scale, zero = weight(72, 2304, 128, True, torch.bfloat16, seed=1)
    x = torch.randn(3, 2304, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    got = w4a16_gemv_mma(x, packed, scale, zero, 128, config=config, lean=lean, unroll=unroll)
    assert_close(got, reference(x, packed, scale, zero, 128))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lean_sums_hold_against_activations_far_from_zero_mean(dtype) -> None:
    """LEAN subtracts (magic + offset) * sum(x) from sums ~17-130x the result: activations of one sign and
    an outlier channel (sum(x) large against the product) still give the plain kernel's outputs within
    the 16-bit output's rounding, and the reference's."""
    packed, scale, zero = weight(64, 4096, 128, True, dtype, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(4, 4096, generator=gen) + 0.5
    x[:, 7] = 300.0
    x = x.to("cuda", dtype)
    lean = w4a16_gemv_mma(x, packed, scale, zero, 128, lean=True)
    plain = w4a16_gemv_mma(x, packed, scale, zero, 128, lean=False)
    want = reference(x, packed, scale, zero, 128)
    assert_close(lean, want)
    torch.testing.assert_close(lean.double(), plain.double(), atol=4e-3 * want.abs().max().item(), rtol=8e-3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("m", "half"), [(1, 40), (4, 37), (8, 64)])
@pytest.mark.parametrize("lean", [False, True])
def test_silu_and_multiply_in_the_store_rounds_as_the_separate_launches(m, half, lean) -> None:
    packed, scale, zero = weight(2 * half, 512, 128, False, torch.bfloat16, seed=half)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    got = w4a16_gemv_mma(x, packed, scale, zero, 128, fusion=GemvFusion(silu_mul=True), lean=lean, unroll=2)
    separate = activation.silu_and_mul(w4a16_gemv_mma(x, packed, scale, zero, 128, lean=lean))
    assert got.shape == (m, half)
    torch.testing.assert_close(got.float(), separate.float(), atol=1e-2, rtol=1e-2)
    # and with a bias, which comes before the activation: the separate launches
    bias = torch.randn(2 * half, device="cuda", dtype=torch.bfloat16)
    with_bias = w4a16_gemv_mma(x, packed, scale, zero, 128, bias, fusion=GemvFusion(silu_mul=True))
    want = activation.silu_and_mul(w4a16_gemv_mma(x, packed, scale, zero, 128) + bias)
    torch.testing.assert_close(with_bias.float(), want.float(), atol=1e-2, rtol=1e-2)


@gpu
@pytest.mark.gpu
def test_strided_rows_leading_dims_bias_and_large_activations() -> None:
    packed, scale, zero = weight(48, 1024, 128, True, torch.bfloat16, seed=9)
    gen = torch.Generator().manual_seed(3)
    wide = (torch.randn(2, 3, 1024 + 64, generator=gen) * 1e4).to("cuda", torch.bfloat16)
    x = wide[..., :1024]  # rows 1,088 apart, as a slice of a fused projection's output
    bias = torch.randn(48, generator=gen).to("cuda", torch.bfloat16)
    got = w4a16_gemv_mma(x, packed, scale, zero, 128, bias)
    assert got.shape == (2, 3, 48)
    want = reference(x.reshape(6, 1024), packed, scale, zero, 128) + bias.double()
    assert_close(got.reshape(6, 48), want)


@gpu
@pytest.mark.gpu
def test_pdl_launches_in_a_graph_read_what_the_launch_before_wrote() -> None:
    """Captured with PDL after a kernel that writes x: the wait orders the reads of x after it."""
    packed, scale, zero = weight(4096, 4096, 128, False, torch.bfloat16, seed=4)
    source = torch.randn(1, 4096, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    x = torch.zeros_like(source)
    with pdl.in_graphs():
        w4a16_gemv_mma(x, packed, scale, zero, 128)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.copy_(source * 2)
            out = w4a16_gemv_mma(x, packed, scale, zero, 128)
            out2 = w4a16_gemv_mma(out[:, :4096], packed, scale, zero, 128)
    graph.replay()
    torch.cuda.synchronize()
    want = reference(source.double() * 2, packed, scale, zero, 128)
    assert_close(out, want)
    assert_close(out2, reference(out, packed, scale, zero, 128))


def test_supports_only_what_it_can() -> None:
    device = "cuda" if CUDA else "cpu"
    packed, scale, zero = make_weight(32, 256, 128, True, seed=0)
    packed, scale = packed.to(device), scale.to(device, torch.bfloat16)
    zero = zero.to(device)
    x = torch.randn(2, 256, device=device, dtype=torch.bfloat16)
    if not CUDA:
        assert not supports(x, packed, scale, zero, 128)  # a CPU tensor: the reference path
        return
    assert supports(x, packed, scale, zero, 128) == cuda_rtc.available()
    assert not supports(x.float(), packed, scale, zero, 128)  # fp32 activations: the Triton kernels
    assert not supports(torch.randn(9, 256, device=device, dtype=torch.bfloat16), packed, scale, zero, 128)
    p64, s64, z64 = make_weight(32, 256, 64, True, seed=0)
    assert not supports(x, p64.cuda(), s64.cuda(), z64.cuda(), 64)  # groups under a chunk
    p200, s200, _ = make_weight(32, 200, 200, False, seed=0)  # K not a multiple of a chunk
    x200 = torch.randn(1, 200, device=device, dtype=torch.bfloat16)
    assert not supports(x200, p200.cuda(), s200.cuda(), None, 200)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 9])
@pytest.mark.parametrize("long_weight", [False, True])
def test_int4_linear_routes_decode_rows_here(monkeypatch, rows, long_weight) -> None:
    """MIN_ROWS-8 rows, and one row of a weight of at most ONE_ROW_MAX_VALUES values (a longer one stays on
    the Triton one-row kernel, faster there); the bound is lowered here to keep the weights small."""
    assert w4a16_gemv_cuda.MMA_GEMV and w4a16_gemv_cuda.MIN_ROWS == 2
    monkeypatch.setattr(w4a16_gemv_cuda, "ONE_ROW_MAX_VALUES", 40 * 512)
    taken = []
    real = w4a16_gemv_cuda.w4a16_gemv_mma
    monkeypatch.setattr(w4a16_gemv_cuda, "w4a16_gemv_mma", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    n = 48 if long_weight else 40
    packed, scale, zero = weight(n, 512, 128, True, torch.bfloat16, seed=rows)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    got = int4_gemm.w4a16_linear(x, packed, scale, zero, 128)
    assert taken == ([1] if 2 <= rows <= 8 or (rows == 1 and not long_weight) else [])
    assert_close(got, reference(x, packed, scale, zero, 128))


@gpu
@pytest.mark.gpu
def test_the_layers_fused_gemv_routes_here_with_the_switch_on(monkeypatch) -> None:
    """layers/quantization/int4.py: with MMA_GEMV three decode rows' gate/up projection is offered to this
    kernel's gated store (int4_gemv_takes), and int4_matmul computes it here; without, the Triton kernel
    of several rows takes it unfused."""
    from tokenmill.layers.quantization.int4 import int4_gemv_takes, int4_matmul

    packed, scale, zero = weight(2 * 48, 1024, 128, True, torch.bfloat16, seed=6)
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)
    taken = []
    real = w4a16_gemv_cuda.w4a16_gemv_mma
    monkeypatch.setattr(w4a16_gemv_cuda, "w4a16_gemv_mma", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    for on in (True, False):
        monkeypatch.setattr(w4a16_gemv_cuda, "MMA_GEMV", on)
        taken.clear()
        assert int4_gemv_takes(x, packed, scale, zero, 128) == on  # (the packed-fp16 kernel takes <= 2 rows)
        fusion = GemvFusion(silu_mul=True) if on else None
        got = int4_matmul(x, packed, scale, zero, 128, None, fusion)
        if not on:
            got = activation.silu_and_mul(got)
        assert taken == ([1] if on else [])
        want = activation.silu_and_mul(reference(x, packed, scale, zero, 128).to(torch.bfloat16))
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
