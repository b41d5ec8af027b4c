"""kernels/dequant8.py's 8-bit group dequantization against quant_reference.dequantize_8bit_groups, bit
for bit: groups of 32 and 128 columns, one group a row (per channel), zero points or none, e4m3 values,
rows and columns that are not multiples of the tiles, a strided weight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.kernels import quant_reference  # noqa: E402
from tokenmill.kernels.dequant8 import dequantize_8bit_groups  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("n", "k", "group", "zeros", "values"),
    [
        (70, 300, 32, True, "int8"),  # 300 = 9 groups + 12: a ragged last group and tile
        (33, 256, 128, False, "int8"),
        (45, 200, 200, True, "int8"),  # one group a row
        (19, 160, 32, False, "e4m3"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_reference_bit_for_bit(
    n: int, k: int, group: int, zeros: bool, values: str, dtype
) -> None:
    gen = torch.Generator().manual_seed(n * k + group)
    groups = -(-k // group)
    w_q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    if values == "e4m3":
        w_q = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 1e-4
    zero = torch.randint(-128, 128, (n, groups), generator=gen, dtype=torch.int8) if zeros else None
    w_q, scale = w_q.to(DEVICE), scale.to(DEVICE)
    zero = zero.to(DEVICE) if zero is not None else None
    got = dequantize_8bit_groups(w_q, scale, zero, group, dtype)
    want = quant_reference.dequantize_8bit_groups(w_q, scale, zero, group, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got, want)


def test_per_channel_scale_and_strided_weight() -> None:
    gen = torch.Generator().manual_seed(3)
    full = torch.randint(-128, 128, (24, 200), generator=gen, dtype=torch.int8).to(DEVICE)
    w_q = full[:, :150]  # rows 200 bytes apart
    scale = (torch.rand(24, 1, generator=gen) * 0.01).to(DEVICE)
    got = dequantize_8bit_groups(w_q, scale, None, 150, torch.bfloat16)
    assert torch.equal(got, quant_reference.dequantize_8bit_groups(w_q, scale, None, 150, torch.bfloat16))
    with pytest.raises(ValueError, match="bf16 or fp16"):
        dequantize_8bit_groups(w_q, scale, None, 150, torch.float32)
