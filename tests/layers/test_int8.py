"""layers/quantization/int8.py: the INT8 checkpoints' arithmetic against compressed-tensors' own (the
packing, the dynamic activation scales) and against the fp64 product of what it quantized; on a GPU,
the skinny W8A16 kernel and the int8 GEMM that int8_linear hands large batches to."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.quantization.int8 import int8_linear, quantize_int8_per_row, unpack_int8

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("columns", [4, 13, 64, 100])
def test_unpacking_inverts_the_librarys_8_bit_packing(columns: int) -> None:
    gen = torch.Generator().manual_seed(columns)
    values = torch.randint(-128, 128, (7, columns), generator=gen, dtype=torch.int8)
    packed = pack_to_int32(values, 8)
    assert torch.equal(unpack_int8(packed, columns), values)
    with pytest.raises(ValueError, match="fewer than"):
        unpack_int8(packed, columns + 4 * packed.shape[1])


def test_dynamic_activation_scales_are_the_librarys() -> None:
    """Per token, symmetric, as compressed-tensors computes a dynamic int8 activation's scale and
    rounds to it: the same integers."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 70, generator=gen) * torch.logspace(-2, 2, 9)[:, None]
    q, scale = quantize_int8_per_row(x)
    args = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
    want_scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    torch.testing.assert_close(scale, want_scale.float(), rtol=1e-6, atol=0)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert torch.equal(q.float() * scale, fake_quantize(x, want_scale, zero, args))


def _weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(
        n, 1, generator=gen
    ) * 1e-3


@pytest.mark.parametrize("scheme", ["token", "tensor", None])
def test_the_cpu_path_is_the_fake_quantized_product(scheme: str | None) -> None:
    gen = torch.Generator().manual_seed(1)
    w_q, w_scale = _weight(24, 40, gen)
    x, bias = torch.randn(2, 3, 40, generator=gen), torch.randn(24, generator=gen)
    input_scale = torch.tensor([0.02])
    got = int8_linear(x, w_q, w_scale, bias, scheme, input_scale if scheme == "tensor" else None)
    x2 = x.reshape(-1, 40)
    if scheme == "token":
        x_q, x_scale = quantize_int8_per_row(x2)
        x2 = x_q.double() * x_scale.double()
    elif scheme == "tensor":  # values past 127 steps of the scale saturate
        x2 = (x2 / input_scale).round().clamp(-128, 127).double() * input_scale.double()
    want = x2.double() @ (w_q.double() * w_scale.double()).t() + bias.double()
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got.reshape(-1, 24).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 300, 600])
@pytest.mark.parametrize("scheme", ["token", "tensor", None])
def test_on_the_gpu_each_batch_size_takes_its_kernel(rows: int, scheme: str | None) -> None:
    """Up to 16 rows the skinny W8A16 kernel (activations as they are), past them the Triton row-wise GEMM
    on int8 operands (weight-only: the grouped W8A16 kernel up to 128 rows, then the dequantized weight);
    N = 1,000, K = 4,104 (not multiples of their tiles)."""
    gen = torch.Generator().manual_seed(rows)
    w_q, w_scale = _weight(1000, 4104, gen)
    x = torch.randn(rows, 4104, generator=gen).to(torch.bfloat16)
    input_scale = torch.tensor([0.03])
    got = int8_linear(
        x.cuda(), w_q.cuda(), w_scale.cuda(), None, scheme, input_scale.cuda() if scheme == "tensor" else None
    ).cpu()
    x2 = x.double()
    if rows > 16 and scheme == "token":
        x_q, x_scale = quantize_int8_per_row(x.float())
        x2 = x_q.double() * x_scale.double()
    elif rows > 16 and scheme == "tensor":
        x2 = (x.float() / input_scale).round().clamp(-128, 127).double() * input_scale.double()
    want = x2 @ (w_q.double() * w_scale.double()).t()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
