"""How a tensor-parallel layer's sizes and checkpoint tensors split over the ranks: the widths a rank holds
(a ValueError naming what tp_size does not split), a rank's slice of a full tensor (of the right kind
of dtype), a fused tensor's parts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ShardId = str | int | None
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId], None]


def heads_per_rank(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int, int]:
    """(query heads, KV heads, ranks holding each KV head) of one rank: query heads split evenly; KV
    heads split too, or, when there are fewer than ranks, each is replicated on tp_size / num_kv_heads
    consecutive ranks. A ValueError names what tp_size does not split."""
    num_heads = divide(num_heads, tp_size, "num_heads")
    if tp_size < num_kv_heads:
        return num_heads, divide(num_kv_heads, tp_size, "num_kv_heads"), 1
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tp_size ({tp_size}) is not a multiple of num_kv_heads ({num_kv_heads}), so KV heads cannot be "
            "replicated evenly; pick a tp_size that is."
        )
    return num_heads, 1, tp_size // num_kv_heads


def divide(numerator: int, tp_size: int, what: str) -> int:
    if numerator % tp_size:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tp_size ({tp_size}); pick a tp_size that divides it."
        )
    return numerator // tp_size


_FP8_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


def _dtype_kind(dtype: torch.dtype) -> str:
    if dtype in _FP8_DTYPES:
        return str(dtype).removeprefix("torch.")  # each FP8 format its own: a copy between them rounds
    return "floating-point" if dtype.is_floating_point else "integer"


def check_dtype(want: torch.dtype, loaded: torch.Tensor) -> None:
    """A ValueError where a checkpoint tensor is not of the kind its parameter holds (packed integers read
    as floats, an FP8 weight stored in bf16 beside its scales): copy_ would cast it and load nonsense."""
    if _dtype_kind(loaded.dtype) != _dtype_kind(want):
        raise ValueError(
            f"dtype {str(loaded.dtype).removeprefix('torch.')} is not the expected {_dtype_kind(want)} dtype"
        )


def load_shard(
    dest: torch.Tensor, loaded: torch.Tensor, dim: int | None, shard_rank: int, num_shards: int
) -> None:
    """Copy slice `shard_rank` of `loaded` cut into `num_shards` equal slices along `dim` (all of it when
    dim is None) into `dest`, once `loaded` has proved to be exactly the full tensor, of dest's kind."""
    check_dtype(dest.dtype, loaded)
    expected = list(dest.shape)
    if dim is not None:
        expected[dim] *= num_shards
    if list(loaded.shape) != expected:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {tuple(expected)}")
    if dim is not None:
        loaded = loaded.narrow(dim, shard_rank * dest.shape[dim], dest.shape[dim])
    dest.copy_(loaded)


def check_columns_split(columns: int, group: int, tp_size: int, what: str) -> None:
    """A ValueError where a row-parallel layer's input columns a rank (`columns`) are not whole groups of
    `group` (a quantization group or block: each rank scales its own columns); `what` names the config
    field and its value."""
    if tp_size > 1 and columns % group:
        raise ValueError(
            f"{what} does not divide the {columns} input columns of each of the {tp_size} ranks "
            "(--tensor-parallel-size) of this layer"
        )


def split_fused(loaded_weight: torch.Tensor, dim: int, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """A fused checkpoint tensor cut into its logical outputs along `dim`."""
    if loaded_weight.shape[dim] != sum(sizes):
        raise ValueError(
            f"fused size {loaded_weight.shape[dim]} along dim {dim} is not the expected {sum(sizes)}"
        )
    return loaded_weight.split(sizes, dim=dim)
