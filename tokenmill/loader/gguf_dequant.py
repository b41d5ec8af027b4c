"""GGUF tensors to float32 torch tensors. The block formats most files use (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, and the k-quants of Q4_K_M and Q5_K_M files: Q4_K, Q5_K, Q6_K) and the float ones are unpacked
here with torch operations over chunks of blocks, bit for bit what the gguf package's numpy
dequantization gives (the same float32 products and sums). The package splits a tensor into groups of
16 rows: on a small model's narrow rows that took ~1.2 s of the ~1.5 s an engine spent building the
embedded SmolLM2 on a CPU (0.4 s here); on a 4096 x 4096 tensor this is 1.3-1.9x faster at one thread,
and it uses torch's threads. Every other type goes through the package."""

from __future__ import annotations

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType


def dequantize(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    """`data` as the gguf reader lays it out (bytes by rows for a block format) to a new float32 tensor of
    the weights' shape, in the file's order ([rows, columns] as numpy reads them)."""
    if tensor_type in (Q.F32, Q.F16, Q.BF16):
        return _floats(data, tensor_type)
    unpack = _BLOCK_FORMATS.get(tensor_type)
    if unpack is None:
        return torch.from_numpy(np.array(gguf.quants.dequantize(data, tensor_type), dtype=np.float32))
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    shape = gguf.quant_shape_from_byte_shape(data.shape, tensor_type)
    packed = np.ascontiguousarray(data).reshape(-1, type_size)
    weights = torch.empty(packed.shape[0], block_size)
    # A chunk of blocks at a time, so that the unpacking's intermediates stay in the CPU's caches.
    for start in range(0, packed.shape[0], _CHUNK_BLOCKS):
        blocks = torch.from_numpy(packed[start : start + _CHUNK_BLOCKS].copy())
        weights[start : start + blocks.shape[0]] = unpack(blocks, block_size)
    return weights.reshape(shape)


_CHUNK_BLOCKS = 2048


def _floats(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    if tensor_type == Q.BF16:  # the reader hands bfloat16 over as bytes
        shape = (*data.shape[:-1], data.shape[-1] // 2)
        words = torch.from_numpy(np.ascontiguousarray(data).view(np.int16).copy()).reshape(shape)
        return words.view(torch.bfloat16).float()
    return torch.from_numpy(np.array(data, dtype=np.float32))


def _scale(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 number at byte `start` of every block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """A block's 4-bit values: the low nibbles of its bytes first, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q8_0(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    return _scale(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _q4_0(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    return _scale(blocks, 0) * (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    return _scale(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _scale(blocks, 2)


def _bits(packed: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """Fields of `width` bits: each run of `group` bytes gives its lowest field of every byte first,
    then the next ones up (ggml's layout), as [blocks, fields, group]."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).reshape(1, 1, -1, 1)
    fields = (packed.reshape(packed.shape[0], -1, 1, group) >> shifts) & ((1 << width) - 1)
    return fields.reshape(packed.shape[0], -1, group)


def _fifth_bits(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Q5_0/Q5_1: the 32 high bits of a block, one a value, from a little-endian 32-bit word."""
    return _bits(blocks[:, start : start + 4], 1, 1).reshape(blocks.shape[0], 32)


def _q5_0(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    low = _nibbles(blocks[:, 6:])
    return _scale(blocks, 0) * ((low | (_fifth_bits(blocks, 2) << 4)).to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    low = _nibbles(blocks[:, 8:])
    return _scale(blocks, 0) * (low | (_fifth_bits(blocks, 4) << 4)).float() + _scale(blocks, 2)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: the super-block's eight 6-bit scales and minimums (12 bytes after d and dmin), each
    times its fp16 factor, as [blocks, 8, 1]."""
    packed = blocks[:, 4:16].reshape(-1, 3, 4)
    low, high, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = torch.cat([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    mins = torch.cat([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], dim=1)
    scale, minimum = (_scale(blocks, 0) * scales.float()), (_scale(blocks, 2) * mins.float())
    return scale.unsqueeze(-1), minimum.unsqueeze(-1)


def _q4_k(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    scale, minimum = _k_scales(blocks)
    return (scale * _bits(blocks[:, 16:], 4, 32).float() - minimum).reshape(-1, block_size)


def _q5_k(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    scale, minimum = _k_scales(blocks)
    values = _bits(blocks[:, 48:], 4, 32) | (_bits(blocks[:, 16:48], 1, 32) << 4)
    return (scale * values.float() - minimum).reshape(-1, block_size)


def _q6_k(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16 values), fp16 d."""
    count = blocks.shape[0]
    low = _bits(blocks[:, :128], 4, 64).reshape(count, -1, 32)
    high = _bits(blocks[:, 128:192], 2, 32)
    values = ((low | (high << 4)).to(torch.int8) - 32).reshape(count, 16, -1).float()
    scale = (_scale(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).reshape(count, 16, 1)
    return (scale * values).reshape(-1, block_size)


_BLOCK_FORMATS = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}  # fmt: skip
