"""The loader's own unpacking of GGUF block formats against the gguf package's numpy dequantization, bit
for bit, on awkward shapes (rows not a power of two, a 3-D experts tensor) and values that fill every
4-bit code; other types go through the package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.loader.gguf_dequant import dequantize

Q = gguf.GGMLQuantizationType
SHAPES = [(1, 256), (3, 1280), (7, 768), (2, 3, 512)]  # k-quant super-blocks hold 256 values
BLOCK_FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# The package quantizes none of the k-quants: they are tested on random bytes below.
FORMATS = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16, Q.F16, Q.F32]


@pytest.mark.parametrize("tensor_type", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_equal_to_the_gguf_package(tensor_type: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(hash((int(tensor_type), shape)) % 2**32)
    values = (rng.standard_normal(shape) * rng.uniform(0.01, 3.0, (*shape[:-1], 1))).astype(np.float32)
    values.reshape(-1)[::17] = 0.0  # zeros inside blocks, and a block's extremes on the nibble range's ends
    data = gguf.quants.quantize(values, tensor_type)
    expected = gguf.quants.dequantize(data, tensor_type)
    got = dequantize(data, tensor_type)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    assert np.array_equal(got.numpy(), expected), tensor_type.name
    # A new tensor: the loader hands it on and the data it came from may be a read-only memory map.
    assert not np.shares_memory(got.numpy(), data)


# Where each format keeps its fp16 factors (byte offsets in a block): random bytes there could be NaN.
FP16_AT = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2)}
FP16_AT |= {Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}


@pytest.mark.parametrize("tensor_type", [*BLOCK_FORMATS, Q.Q2_K])  # Q2_K: through the package
def test_every_byte_pattern(tensor_type: gguf.GGMLQuantizationType) -> None:
    """Random bytes for the packed values and scales (every code of every field), finite fp16 factors."""
    rng = np.random.default_rng(int(tensor_type))
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, (5 * 9, type_size), dtype=np.uint8)
    for start in FP16_AT[tensor_type]:
        blocks[:, start : start + 2] = rng.uniform(-2, 2, (5 * 9, 1)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(5, 9 * type_size)
    expected = gguf.quants.dequantize(data, tensor_type)
    assert np.array_equal(dequantize(data, tensor_type).numpy(), expected)
