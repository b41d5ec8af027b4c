"""kernels/w4a16_mma.py against the dequantize-then-matmul reference: awkward row and column counts,
K splits, zero points or none, bf16 and fp16 (in the interpreter on a CPU: the nibbles by shifts; on a
GPU: by the inline PTX)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import quant_reference as ref
from tokenmill.kernels.skinny_gemm import SkinnyConfig
from tokenmill.kernels.w4a16_mma import MAX_ROWS, block_rows, default_config, supports, w4a16_mma

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make(n: int, k: int, group: int, zero_points: bool, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).to(dtype)
    zero = torch.randint(-3, 4, (n, k // group), dtype=torch.int8, generator=gen) if zero_points else None
    return [t.to(DEVICE) if t is not None else None for t in (ref.pack_int4(q), scale, zero)]


@pytest.mark.parametrize(
    "rows,n,k,group,zero_points,split",
    [
        (1, 40, 256, 128, True, 1),
        (3, 70, 512, 256, False, 2),
        (16, 33, 384, 128, True, 3),
        (1, 64, 1024, 128, False, 4),
        (17, 40, 256, 128, True, 2),  # 32 activation rows a program
        (50, 33, 256, 128, False, 1),  # 64 a program, rows past M masked
        (64, 48, 384, 128, True, 3),
        (100, 40, 256, 128, True, 2),  # two blocks of 64 activation rows
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swap", [False, True])
def test_matches_the_dequantized_matmul(rows, n, k, group, zero_points, split, dtype, swap) -> None:
    packed, scale, zero = make(n, k, group, zero_points, dtype)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    config = SkinnyConfig(block_n=32, block_k=128, split_k=split, num_warps=4, num_stages=2)
    got = w4a16_mma(x, packed, scale, zero, group, config=config, swap=swap)
    want = ref.w4a16_gemm(x, packed, scale, zero, group)
    assert got.shape == (rows, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_default_tiles_split_k_over_every_block_of_rows() -> None:
    assert [block_rows(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    one = default_config(4096, 4096, DEVICE, m=1).split_k
    assert default_config(4096, 4096, DEVICE, m=64).split_k <= one  # four blocks of 16 rows' programs


def test_weight_rows_a_program_by_batch() -> None:
    from tokenmill.kernels import sm_count

    assert default_config(4096, 4096, DEVICE, m=2).block_n == 64
    assert default_config(4096, 4096, DEVICE, m=64).block_n == 64
    # Past 64 rows, 128 weight rows a program unless that leaves SMs without one.
    wide = 128 * sm_count(DEVICE)
    assert default_config(wide, 4096, DEVICE, m=100).block_n == 128
    assert default_config(wide // 4, 4096, DEVICE, m=100).block_n == 64


def test_bias_and_leading_dims_and_default_tiles() -> None:
    packed, scale, zero = make(48, 512, 128, True, torch.bfloat16)
    x = torch.randn(2, 1, 512).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(48).to(torch.bfloat16).to(DEVICE)
    got = w4a16_mma(x, packed, scale, zero, 128, bias)
    want = ref.w4a16_gemm(x, packed, scale, zero, 128, bias)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert default_config(512, 4096, DEVICE).split_k > 1  # 4 tiles of 128 rows: K splits fill the GPU


def test_refuses_what_it_cannot_take() -> None:
    packed, scale, zero = make(16, 256, 128, False, torch.bfloat16)
    assert supports(torch.empty(MAX_ROWS, 256, dtype=torch.bfloat16), 128, 256)
    assert not supports(torch.empty(MAX_ROWS + 1, 256, dtype=torch.bfloat16), 128, 256)
    assert not supports(torch.empty(1, 256, dtype=torch.bfloat16), 64, 256)  # groups under 128 values
    assert not supports(torch.empty(1, 256, dtype=torch.float32), 128, 256)
    with pytest.raises(ValueError, match="w4a16_mma takes"):
        w4a16_mma(torch.empty(1, 256, dtype=torch.float32, device=DEVICE), packed, scale, zero, 128)
