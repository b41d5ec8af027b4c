"""The skinny (decode-sized) Triton GEMMs against dequantize-then-matmul: one row and several, K not a
multiple of the tile or of eight, zero points, split K, N not a multiple of the tile, bias, leading dims
(through the interpreter on a CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tokenmill.kernels import gemv  # noqa: E402
from tokenmill.kernels.quant_reference import dequantize_int4, w8a16_gemm  # noqa: E402
from tokenmill.kernels.reference import FP8_DTYPE  # noqa: E402
from tokenmill.kernels.skinny_gemm import (  # noqa: E402
    MAX_ROWS,
    SkinnyConfig,
    dense_gemv,
    w4a16_skinny,
    w8a16_skinny,
)

from .test_int4_gemm import make_weight  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def int4_weight(n: int, k: int, group: int, zeros: bool, seed: int):
    """test_int4_gemm's random packed weight, its scales in bf16 as checkpoints store them."""
    packed, scale, zero = make_weight(n, k, group, zeros, seed)
    return packed, scale.to(torch.bfloat16), zero


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "config"),
    [
        (1, 64, 128, 32, False, SkinnyConfig(16, 64, 1, 4, 2)),
        (1, 72, 200, 64, True, SkinnyConfig(16, 128, 2, 4, 2)),  # K not a multiple of the tile or of 8
        (1, 130, 1024, 128, True, SkinnyConfig(32, 256, 3, 4, 2)),  # uneven split of K
        (1, 64, 1024, 128, False, SkinnyConfig(16, 256, 2, 4, 1)),  # even split: no masks along K
        (1, 40, 2048, 64, True, SkinnyConfig(8, 256, 2, 4, 1, prefetch=True)),  # loads a step ahead
        (1, 24, 512, 128, False, SkinnyConfig(8, 512, 1, 4, 1, prefetch=True)),  # one step a program
        (1, 50, 512, 16, True, SkinnyConfig(16, 128, 1, 2, 1, unroll=2)),  # scale every 2 words
        (1, 40, 768, 768, False, SkinnyConfig(8, 256, 1, 4, 1)),  # one group per row (per channel)
        (1, 24, 256, 8, True, SkinnyConfig(8, 64, 1, 2, 1)),  # a scale per word
        (3, 40, 96, 32, True, SkinnyConfig(32, 128, 1, 4, 2)),
        (MAX_ROWS, 96, 384, 128, False, SkinnyConfig(16, 128, 2, 4, 2)),
        (5, 50, 256, 16, True, None),  # the default tiles
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w4a16_matches_dequantize_then_matmul(m, n, k, group, zeros, config, dtype) -> None:
    packed, scale, zero = int4_weight(n, k, group, zeros, seed=m * n + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    got = w4a16_skinny(x, packed, scale, zero, group, bias, config=config)
    weight = dequantize_int4(packed, scale, zero, group, k, torch.float64)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_close(got, x.double() @ weight.t() + bias.double(), dtype)


@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_one_row_in_fp16_halves_keeps_every_magnitude(magnitude, dtype) -> None:
    """The one-row 16-bit path sums in fp16 halves after scaling x: activations far beyond fp16's range
    (in bf16), tiny ones, and an outlier among small values all come out as the fp64 reference."""
    from tokenmill.kernels import skinny_gemm

    assert skinny_gemm.GEMV4_F16X2
    n, k, group = 40, 1024, 128
    packed, scale, zero = int4_weight(n, k, group, True, seed=3)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=gen) * magnitude
    if dtype == torch.bfloat16:
        x = x * 1e5  # up to ~1e8 with the largest magnitude: beyond fp16, as bf16 activations may be
    x[0, 77] = min(x.abs().max().item() * 50, 2e4 if dtype == torch.float16 else 1e12)  # one outlier
    x = x.to(DEVICE, dtype)
    config = SkinnyConfig(8, 256, 2, 4, 1)
    got = w4a16_skinny(x, packed, scale, zero, group, config=config)
    weight = dequantize_int4(packed, scale, zero, group, k, torch.float64)
    want = x.double() @ weight.t()
    assert torch.isfinite(got).all()
    assert_close(got, want, dtype)


# The default switches at every magnitude; the other three at 1.0 in the default suite, at all under -m slow.
PAIRED_SWITCHES = [
    {"GEMV4_PAIRED": True, "GEMV4_WIDE_X": True},  # the default
    {"GEMV4_PAIRED": True, "GEMV4_WIDE_X": False},
    {"GEMV4_PAIRED": False, "GEMV4_WIDE_X": True},
    {"GEMV4_PAIRED": False, "GEMV4_WIDE_X": False},
]
PAIRED_CASES = [
    pytest.param(magnitude, switches, marks=pytest.mark.slow)
    if magnitude != 1.0 and switches is not PAIRED_SWITCHES[0]
    else pytest.param(magnitude, switches)
    for magnitude in (1e-4, 1.0, 1e4)
    for switches in PAIRED_SWITCHES
]


@pytest.mark.parametrize(
    ("m", "n", "k", "group", "zeros", "config"),
    [
        (1, 40, 1024, 128, False, SkinnyConfig(8, 256, 1, 4, 1)),
        (1, 72, 512, 32, True, SkinnyConfig(16, 128, 2, 4, 1)),  # K split, zero points
        (2, 48, 768, 64, True, SkinnyConfig(16, 256, 1, 4, 1, prefetch=True)),  # two rows, a step ahead
        (1, 24, 200, 8, False, None),  # groups of one word (SUB 1): unpaired; K past the tile
    ],
)
@pytest.mark.parametrize(("magnitude", "switches"), PAIRED_CASES)
def test_w4a16_paired_words_match_dequantize_then_matmul(
    m, n, k, group, zeros, config, magnitude, switches
) -> None:
    """The packed-fp16 kernel's two words' sixteen products summed in fp16 before fp32 (GEMV4_PAIRED)
    and each word's activations in one vector load (GEMV4_WIDE_X), both, and neither: the fp64
    reference still, over magnitudes, zero points, K splits, two rows and the prefetching loop."""
    from tokenmill.kernels import skinny_gemm

    packed, scale, zero = int4_weight(n, k, group, zeros, seed=n + k + group)
    gen = torch.Generator().manual_seed(k + group)
    x = (torch.randn(m, k, generator=gen) * magnitude).to(DEVICE, torch.bfloat16)
    with skinny_gemm.switches(**switches):
        got = w4a16_skinny(x, packed, scale, zero, group, config=config)
    weight = dequantize_int4(packed, scale, zero, group, k, torch.float64)
    assert torch.isfinite(got).all()
    assert_close(got, x.double() @ weight.t(), torch.bfloat16)


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (1, 64, 128, SkinnyConfig(16, 64, 1, 4, 2)),
        (1, 72, 200, SkinnyConfig(16, 64, 2, 4, 2)),  # K not a multiple of the tile, split K
        (1, 64, 1024, SkinnyConfig(16, 128, 2, 4, 1)),  # even split: no masks along K
        (1, 40, 512, SkinnyConfig(8, 128, 1, 2, 1, unroll=3)),
        (2, 130, 96, SkinnyConfig(32, 32, 1, 4, 2)),
        (MAX_ROWS, 48, 320, SkinnyConfig(16, 64, 3, 4, 2)),
        (7, 33, 64, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "weight", ["e4m3", "int8"]
)  # FP8 checkpoints' and INT8 ones' (layers/quantization/int8.py)
def test_w8a16_matches_dequantize_then_matmul(m, n, k, config, dtype, weight) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    if weight == "int8":
        w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    w_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    got = w8a16_skinny(x, w_q.to(DEVICE), w_scale.to(DEVICE), config=config)
    want = x.double() @ (w_q.double() * w_scale.double()).t().to(DEVICE)
    assert got.dtype == dtype and got.shape == (m, n)
    assert_close(got, want, dtype)
    reference = w8a16_gemm(x.double(), w_q.to(DEVICE), w_scale.to(DEVICE))
    assert_close(reference, want, torch.float32)


@pytest.mark.parametrize(
    ("n", "k", "config"),
    [
        (64, 128, SkinnyConfig(16, 64, 1, 4, 2)),
        (72, 200, SkinnyConfig(16, 64, 2, 4, 2)),  # K not a multiple of the tile, split K
        (64, 1024, SkinnyConfig(16, 128, 2, 4, 1)),  # even split: no masks along K
        (40, 520, SkinnyConfig(8, 128, 1, 2, 1, unroll=3)),
        (4100, 264, None),  # the default tiles, N past a tile
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv_matches_matmul(n, k, config, dtype) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    x = torch.randn(1, 1, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    got = dense_gemv(x, w, bias, config=config)
    assert got.dtype == dtype and got.shape == (1, 1, n)
    assert_close(got.reshape(1, n), x.reshape(1, k).double() @ w.double().t() + bias.double(), dtype)
    with pytest.raises(ValueError, match="one row"):
        dense_gemv(torch.randn(2, k).to(DEVICE, dtype), w)


# fp16 at the default tiles in the default suite, at every tile under -m slow.
PACKED_ROWS = [
    (2, 1024, 128, False, SkinnyConfig(16, 256, 1, 4, 1)),
    (3, 200, 64, True, SkinnyConfig(8, 128, 2, 4, 1)),  # K not a multiple of the tile or of 8
    (4, 2048, 128, True, SkinnyConfig(8, 256, 2, 4, 1, prefetch=True)),
    (4, 512, 16, False, None),  # a scale every two words; the one-row default tiles
]


@pytest.mark.parametrize(
    ("m", "k", "group", "zeros", "config", "dtype"),
    [
        pytest.param(*case, dtype, marks=pytest.mark.slow)
        if dtype == torch.float16 and case[-1] is not None
        else pytest.param(*case, dtype)
        for case in PACKED_ROWS
        for dtype in (torch.bfloat16, torch.float16)
    ],
)
def test_w4a16_packed_kernel_over_several_rows(m, k, group, zeros, config, dtype, monkeypatch) -> None:
    """skinny_gemm.GEMV4_ROWS: 2-4 rows of 16-bit activations through the packed-fp16 kernel, each weight
    word unpacked once for every row; rows of very different magnitudes scale apart."""
    from tokenmill.kernels import int4_gemm, skinny_gemm

    monkeypatch.setattr(skinny_gemm, "GEMV4_ROWS", 4)
    n = 40
    packed, scale, zero = int4_weight(n, k, group, zeros, seed=m + k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=gen) * torch.tensor([1.0, 1e-3, 30.0, 1.0])[:m, None]
    x = x.to(DEVICE, dtype)
    got = w4a16_skinny(x, packed, scale, zero, group, config=config)
    want = x.double() @ dequantize_int4(packed, scale, zero, group, k, torch.float64).t()
    assert got.shape == (m, n) and got.dtype == dtype
    for row in range(m):  # each row against its own magnitude
        assert_close(got[row : row + 1], want[row : row + 1], dtype)
    assert skinny_gemm.packed_kernel_takes(dtype, m) and not skinny_gemm.packed_kernel_takes(torch.float32, m)
    assert not skinny_gemm.packed_kernel_takes(dtype, 5)
    if group % 128 == 0 and k % group == 0:  # the INT4 linears' dispatch sends these rows here too
        routed = int4_gemm.w4a16_linear(x, packed, scale, zero, group)
        for row in range(m):
            assert_close(routed[row : row + 1], want[row : row + 1], dtype)


@pytest.mark.parametrize(
    ("m", "k", "config"),
    [
        (2, 1024, SkinnyConfig(8, 256, 1, 4, 1)),
        (3, 200, SkinnyConfig(16, 64, 2, 4, 1)),  # K not a multiple of the tile, split K
        (4, 2048, SkinnyConfig(8, 256, 2, 4, 1, unroll=2)),
        (4, 512, None),  # the one-row default tiles
    ],
)
@pytest.mark.parametrize("early", [False, True])
def test_w8a16_and_dense_one_row_kernels_over_several_rows(m, k, config, early, monkeypatch) -> None:
    """skinny_gemm.GEMV8_ROWS and DENSE_ROWS: 2-4 rows through the one-row kernel (each weight tile
    converted once for every row), with the first tile before the PDL wait or not."""
    from tokenmill.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "GEMV8_ROWS", 4)
    monkeypatch.setattr(skinny_gemm, "DENSE_ROWS", 4)
    monkeypatch.setattr(skinny_gemm, "GEMV_EARLY", early)
    n = 40
    gen = torch.Generator().manual_seed(m + k)
    x = (torch.randn(m, k, generator=gen) * torch.tensor([1.0, 1e-3, 30.0, 1.0])[:m, None]).to(
        DEVICE, torch.bfloat16
    )
    w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
    w_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
    got = w8a16_skinny(x, w_q.to(DEVICE), w_scale.to(DEVICE), config=config)
    want = x.double() @ (w_q.double() * w_scale.double()).t().to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
    got_dense = dense_gemv(x, w, config=config)
    want_dense = x.double() @ w.double().t()
    assert got.shape == got_dense.shape == (m, n)
    for row in range(m):  # each row against its own magnitude
        assert_close(got[row : row + 1], want[row : row + 1], torch.bfloat16)
        assert_close(got_dense[row : row + 1], want_dense[row : row + 1], torch.bfloat16)
    assert skinny_gemm.dense_gemv_takes(m) and not skinny_gemm.dense_gemv_takes(5)


@pytest.mark.parametrize("tiles", [1, 3, 8])
@pytest.mark.parametrize("kind", ["w4", "w8", "dense"])
def test_one_row_kernels_with_their_first_tiles_before_the_pdl_wait(kind, tiles, monkeypatch) -> None:
    """skinny_gemm.GEMV_EARLY: the first weight tiles are loaded ahead of the loop (before the PDL wait on
    a GPU; the 4-bit kernel its first only): the results stay those of the reference, over several steps
    a program and split K, with tiles left to the loop (3 of 4) and none (8: all 4)."""
    from tokenmill.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "GEMV_EARLY", tiles)
    n, k = 40, 2048
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    if kind == "w4":
        packed, scale, zero = int4_weight(n, k, 128, True, seed=4)
        got = w4a16_skinny(x, packed, scale, zero, 128, config=SkinnyConfig(8, 256, 2, 4, 1, prefetch=True))
        want = x.double() @ dequantize_int4(packed, scale, zero, 128, k, torch.float64).t()
    elif kind == "w8":
        w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE)
        w_scale = torch.rand(n, 1, generator=gen) * 0.01 + 1e-3
        got = w8a16_skinny(
            x, w_q.to(DEVICE), w_scale.to(DEVICE), config=SkinnyConfig(8, 256, 2, 4, 1, unroll=2)
        )
        want = x.double() @ (w_q.double() * w_scale.double()).t().to(DEVICE)
    else:
        w = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
        got = dense_gemv(x, w, config=SkinnyConfig(16, 512, 1, 4, 1))
        want = x.double() @ w.double().t()
    assert_close(got, want, torch.bfloat16)


def test_early_tiles_are_bounded_by_the_split_the_registers_and_whole_steps(monkeypatch) -> None:
    """skinny_gemm.early_tiles: GEMV_EARLY tiles, at most a split's and what EARLY_BYTES a thread hold;
    none with GEMV_EARLY 0 or where K's steps are not whole tiles."""
    from tokenmill.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "GEMV_EARLY", 8)
    monkeypatch.setattr(skinny_gemm, "EARLY_BYTES", 256)
    fp8_o = SkinnyConfig(8, 2048, 1, num_warps=8, num_stages=1)  # 64 B a thread a tile
    assert skinny_gemm.early_tiles(4096, 1, fp8_o) == 2  # the whole weight
    assert skinny_gemm.early_tiles(14336, 1, fp8_o) == 4  # 256 B a thread
    assert skinny_gemm.early_tiles(14336, 2, fp8_o) == 2  # 16-bit: twice the bytes a tile
    assert skinny_gemm.early_tiles(4096, 1, fp8_o._replace(split_k=2)) == 1
    assert skinny_gemm.early_tiles(4000, 1, fp8_o) == 0  # masked steps
    wide = SkinnyConfig(16, 4096, 1, num_warps=2, num_stages=1)  # 1 KB a thread: one tile all the same
    assert skinny_gemm.early_tiles(8192, 1, wide) == 1
    monkeypatch.setattr(skinny_gemm, "GEMV_EARLY", 0)
    assert skinny_gemm.early_tiles(4096, 1, fp8_o) == 0


def test_switches_are_set_inside_and_restored_after() -> None:
    from tokenmill.kernels import skinny_gemm

    early, rows = skinny_gemm.GEMV_EARLY, skinny_gemm.GEMV4_ROWS
    with skinny_gemm.switches(GEMV_EARLY=not early, GEMV4_ROWS=3):
        assert skinny_gemm.GEMV_EARLY is not early and skinny_gemm.GEMV4_ROWS == 3
    assert skinny_gemm.GEMV_EARLY is early and rows == skinny_gemm.GEMV4_ROWS
    with pytest.raises(ValueError, match="no switch named GEMV_LATE"), skinny_gemm.switches(GEMV_LATE=True):
        pass


def test_leading_dims_empty_batch_and_limits() -> None:
    packed, scale, _ = int4_weight(64, 64, 32, False, seed=1)
    x = torch.randn(2, 3, 64).to(DEVICE)
    got = w4a16_skinny(x, packed, scale, None, 32)
    torch.testing.assert_close(got.reshape(6, 64), w4a16_skinny(x.reshape(6, 64), packed, scale, None, 32))
    assert w4a16_skinny(x[:0, 0], packed, scale, None, 32).shape == (0, 64)
    with pytest.raises(ValueError, match="at most"):
        w4a16_skinny(torch.randn(MAX_ROWS + 1, 64).to(DEVICE), packed, scale, None, 32)


@pytest.mark.parametrize("kind", ["w4", "w8", "dense"])
@pytest.mark.parametrize("work", ["silu_mul", "silu_mul_split", "silu_mul_bias"])
@pytest.mark.parametrize(("m", "k"), [(1, 1024), (2, 200)])
def test_one_row_kernels_do_the_activation_in_their_stores(kind, work, m, k, monkeypatch) -> None:
    """GemvFusion: silu(gate) * up of the output's halves done as the output is stored (in the kernel, or
    after it where K is split or a bias comes first). Equal to the separate launches: the same GEMV,
    then the activation."""
    from tokenmill.kernels import GemvFusion, reference, skinny_gemm

    monkeypatch.setattr(skinny_gemm, "GEMV4_ROWS", 2)
    monkeypatch.setattr(skinny_gemm, "GEMV8_ROWS", 2)
    monkeypatch.setattr(skinny_gemm, "DENSE_ROWS", 2)
    n = 56  # gate || up: 28 outputs, not a multiple of the half tile
    gen = torch.Generator().manual_seed(m * 7 + k)
    dtype = torch.bfloat16
    x = (torch.randn(m, k, generator=gen) * torch.tensor([3.0, 0.05])[:m, None]).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype) if work == "silu_mul_bias" else None
    split = 2 if work.endswith("split") else 1
    fusion = GemvFusion(silu_mul=True)
    if kind == "w4":
        group = 8 if k % 128 else 128
        packed, scale, zero = int4_weight(n, k, group, True, seed=k)
        config = SkinnyConfig(16, 256, split, 4, 1, prefetch=k % 256 == 0)

        def gemv(x, fusion=None):
            return w4a16_skinny(x, packed, scale, zero, group, bias, config, fusion)

    elif kind == "w8":
        w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8_DTYPE).to(DEVICE)
        w_scale = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).to(DEVICE)
        config = SkinnyConfig(16, 256, split, 4, 1, unroll=2)

        def gemv(x, fusion=None):
            return w8a16_skinny(x, w_q, w_scale, bias, config, fusion)

    else:
        w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
        config = SkinnyConfig(8, 128, split, 4, 1)

        def gemv(x, fusion=None):
            return dense_gemv(x, w, bias, config, fusion)

    got = gemv(x, fusion)
    want = reference.silu_and_mul(gemv(x))
    assert got.shape == want.shape == (m, n // 2) and got.dtype == dtype
    # The same sums, rounded where the separate launches round (exp's last bit may flip a rounding).
    torch.testing.assert_close(got, want, atol=0, rtol=1 / 128)


def test_a_fusion_the_kernel_cannot_take_is_refused() -> None:
    from tokenmill.kernels import GemvFusion

    w = torch.randn(41, 64).to(DEVICE, torch.bfloat16)
    x = torch.randn(1, 64).to(DEVICE, torch.bfloat16)
    with pytest.raises(ValueError, match="even number of outputs"):
        dense_gemv(x, w, fusion=GemvFusion(silu_mul=True))
    packed, scale, zero = int4_weight(40, 64, 32, False, seed=1)
    with pytest.raises(ValueError, match="packed-fp16 kernel"):
        w4a16_skinny(x.float(), packed, scale, zero, 32, fusion=GemvFusion())


@pytest.mark.parametrize(
    ("rows", "n", "k", "group", "split", "block_m", "swap"),
    [
        (1, 40, 96, 32, 1, 0, False), (5, 70, 160, 32, 2, 0, False), (16, 33, 144, 48, 3, 0, False),
        (3, 64, 100, 32, 1, 0, False),
        (17, 40, 96, 32, 2, 0, False), (70, 24, 64, 64, 1, 0, False),  # 32 and 64 rows a program
        # The weight's tile as the dot's first operand; a block of rows named by the config.
        (5, 70, 160, 32, 2, 0, True), (70, 40, 100, 32, 1, 0, True), (150, 33, 96, 48, 2, 128, True),
        (20, 40, 64, 64, 1, 0, True),  # per channel, swapped
        (40, 40, 96, 32, 1, 16, False),
    ],
)  # fmt: skip
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_kernel_matches_dequantize_then_matmul(
    rows, n, k, group, split, block_m, swap, zeros, dtype
) -> None:
    """kernels/grouped_w8a16.py's w8a16_grouped (GPTQ's 8-bit groups) against the dequantized product:
    columns past a tile, K split across programs, a short last group (K = 100 in groups of 32), rows in
    blocks of 16, 32 and 64 or the config's (per channel: one group of K), the operands swapped."""
    from tokenmill.kernels import grouped_w8a16, skinny_gemm
    from tokenmill.kernels.quant_reference import dequantize_8bit_groups

    device = DEVICE
    gen = torch.Generator().manual_seed(rows + n + k)
    groups = -(-k // group)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, groups, generator=gen) * 0.01 + 1e-3).to(dtype)
    zero = torch.randint(-20, 20, (n, groups), generator=gen, dtype=torch.int8) if zeros else None
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    config = skinny_gemm.SkinnyConfig(32, 16, split, 4, 2, block_m=block_m, swap_ab=swap)
    args = [t.to(device) if t is not None else None for t in (x, w_q, scale, zero)]
    got = grouped_w8a16.w8a16_grouped(*args, group, bias.to(device), config=config).cpu()
    want = x.double() @ dequantize_8bit_groups(w_q, scale, zero, group, torch.float64).t() + bias.double()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


@pytest.mark.parametrize(
    ("rows", "n", "k", "tiles"),  # tiles: (swap_ab, split_k, block_m) as grouped_config picks them
    [
        (40, 16400, 256, (True, 1, 0)), (40, 48, 8192, (True, 4, 0)),
        # blocks of 128 rows over the wide weight: ~10 s on the interpreter
        pytest.param(100, 16400, 256, (True, 1, 128), marks=pytest.mark.slow),
        (100, 48, 8192, (False, 2, 128)), (100, 40, 256, (False, 1, 128)), (20, 40, 256, (False, 1, 0)),
        (40, 40, 256, (False, 1, 0)),
        (100, 400, 256, (False, 1, 0)),  # past one wave of programs (the CPU counts 8 SMs): blocks of 64
    ],
)  # fmt: skip
def test_the_grouped_kernel_at_its_default_tiles_past_32_rows(rows, n, k, tiles) -> None:
    """w8a16_grouped's own tiles past 32 rows (grouped_config: a wide weight as the dot's first operand,
    a long K split, blocks of 128 rows) against the dequantized product, with zero points."""
    from tokenmill.kernels import grouped_w8a16
    from tokenmill.kernels.quant_reference import dequantize_8bit_groups

    gen = torch.Generator().manual_seed(rows + n + k)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // 128, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    zero = torch.randint(-20, 20, (n, k // 128), generator=gen, dtype=torch.int8)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    config = grouped_w8a16.grouped_config(rows, n, k, 128, 64, torch.device("cpu"))
    assert (config.swap_ab, config.split_k, config.block_m) == tiles
    got = grouped_w8a16.w8a16_grouped(*(t.to(DEVICE) for t in (x, w_q, scale, zero)), 128).cpu()
    want = x.double() @ dequantize_8bit_groups(w_q, scale, zero, 128, torch.float64).t()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@triton.jit
def widen_kernel(src, dst):
    offsets = tl.arange(0, 256)
    tl.store(dst + offsets, gemv.widen(tl.load(src + offsets)))


@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.int8])
def test_widen_gives_every_8bit_value_exactly(dtype) -> None:
    """gemv.widen (int8 by bit operations, no conversion instruction) against torch's conversion, for
    every bit pattern: int8 from -128 to 127; e4m3's subnormals, zeros of both signs and extremes (not
    NaN)."""
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = bits.view(dtype)
    got = torch.empty(256, dtype=torch.float32, device=DEVICE)
    widen_kernel[(1,)](values.to(DEVICE), got)
    want = values.float()
    real = ~want.isnan()
    assert real.sum() >= 254
    torch.testing.assert_close(got.cpu()[real], want[real], rtol=0, atol=0)
    assert torch.equal(got.cpu()[real].view(torch.int32), want[real].view(torch.int32))  # -0.0 stays -0.0
