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
SHAPES = [(1, 32), (3, 160), (7, 96), (2, 3, 64)]


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.BF16, Q.F16, Q.F32, Q.Q5_0, Q.Q5_1])
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


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_every_byte_pattern(tensor_type: gguf.GGMLQuantizationType) -> None:
    """Random bytes for the packed values (every code and both nibbles), finite random scales."""
    rng = np.random.default_rng(int(tensor_type))
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    blocks = rng.integers(0, 256, (5 * 9, type_size), dtype=np.uint8)
    scales = 2 if tensor_type != Q.Q4_1 else 4
    blocks[:, :scales] = rng.uniform(-2, 2, (5 * 9, scales // 2)).astype(np.float16).view(np.uint8)
    data = blocks.reshape(5, 9 * type_size)
    expected = gguf.quants.dequantize(data, tensor_type)
    assert np.array_equal(dequantize(data, tensor_type).numpy(), expected)
