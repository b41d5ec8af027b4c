"""4-bit integer weights with one scale (and, asymmetric, one zero point) per group of input columns,
activations in the model dtype (W4A16), as compressed-tensors' `pack-quantized` format stores them:

- `weight_packed` int32 [N, K/8]: eight 4-bit values per int32 along K, value j of a word in bits
  4j..4j+3, each stored as q + 8 (q in [-8, 7]);
- `weight_scale` [N, ceil(K/group)] in the checkpoint's dtype;
- `weight_zero_point` int32 [N/8, ceil(K/group)] (asymmetric only), packed the same way along N
  (kept unpacked once loaded);
- `weight_shape` [2]: (N, K), checked as it loads.

w[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]. The reference unpacks and dequantizes
the whole weight for each matmul (the CPU path, and the ground truth of the GPU's Triton kernel,
kernels/int4_gemm.py, which dequantizes tile by tile in registers).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.kernels import GemvFusion, triton_kernel
from tokenmill.kernels.quant_reference import (
    PACK,
    dequantize_8bit_groups,
    dequantize_int4,
    pack_int4,
    quantize_int4_symmetric,
    unpack_int4,
    w4a16_gemm,
)
from tokenmill.layers.linear import LinearMethodBase, RowParallelLinear
from tokenmill.layers.sharding import ShardId, WeightLoader, check_columns_split, check_dtype


class Int4W4A16LinearMethod(LinearMethodBase):
    def __init__(
        self, group_size: int, symmetric: bool, group_order: str | None = None, field: str = "group_size"
    ) -> None:
        """group_order: the config field of a checkpoint whose layers store `weight_g_idx` (actorder
        "group"), else None. field: the config field of the group size, for errors."""
        self.group_size, self.field = group_size, field
        self.symmetric = symmetric
        self.group_order = group_order

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None,
        weight_loader: WeightLoader,
    ) -> None:
        rows, columns = sum(output_partition_sizes), input_size_per_partition
        group = self.group_size if self.group_size > 0 else columns
        if isinstance(layer, RowParallelLinear):
            check_columns_split(columns, group, layer.tp_size, f"{self.field} {group}")
        num_groups = math.ceil(columns / group)
        column_parallel = not isinstance(layer, RowParallelLinear)
        packed = _param(torch.zeros(rows, math.ceil(columns / PACK), dtype=torch.int32), 0, 1, weight_loader)
        layer.register_parameter("weight_packed", packed)
        scale = _param(
            torch.zeros(rows, num_groups, dtype=params_dtype or torch.get_default_dtype()),
            0,
            1 if not column_parallel else None,
            weight_loader,
        )
        layer.register_parameter("weight_scale", scale)
        if not self.symmetric:
            # Kept unpacked ([N, groups] int8): the checkpoint packs it along N, and unpacked its rows
            # line up with the weight's for the fused layers' loaders.
            def load_zero(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
                # Packed eight rows a word, the last word padded where the rows are not a multiple of 8.
                check_dtype(torch.int32, loaded)
                unpacked = unpack_int4(loaded.t().contiguous(), loaded.shape[0] * PACK).t()
                rows_stored = checkpoint_rows(layer, shard_id, output_size)
                if unpacked.shape[0] - PACK < rows_stored <= unpacked.shape[0]:
                    unpacked = unpacked[:rows_stored]
                weight_loader(param, unpacked.contiguous(), shard_id)

            zero = _param(
                torch.zeros(rows, num_groups, dtype=torch.int8),
                0,
                1 if not column_parallel else None,
                load_zero,
            )
            layer.register_parameter("weight_zero_point", zero)
        add_weight_shape(layer, input_size)
        layer.int4_group_size = group
        layer.int4_in_features = columns
        if self.group_order is not None:
            add_group_index(layer, "weight_g_idx", columns, self.group_order)

    def after_loading(self, layer: nn.Module) -> None:
        if self.group_order is not None:
            order_input_columns(layer, "weight_packed", self.group_order)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        zero = getattr(layer, "weight_zero_point", None)
        x = ordered_input(layer, x)
        return int4_matmul(x, layer.weight_packed, layer.weight_scale, zero, layer.int4_group_size, bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        zero = getattr(layer, "weight_zero_point", None)
        return dequantize_in_order(layer, layer.weight_packed, layer.weight_scale, zero)

    def gemv_takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        zero = getattr(layer, "weight_zero_point", None)
        return int4_gemv_takes(x, layer.weight_packed, layer.weight_scale, zero, layer.int4_group_size)

    def gemv(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
    ) -> torch.Tensor:
        zero = getattr(layer, "weight_zero_point", None)
        group = layer.int4_group_size
        x = ordered_input(layer, x)
        return int4_matmul(x, layer.weight_packed, layer.weight_scale, zero, group, bias, fusion)


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    fusion: GemvFusion | None = None,
) -> torch.Tensor:
    """x W^T (+ bias) for W in this module's layout: on CUDA kernels/int4_gemm.py's w4a16_linear (the
    kernel chosen by the batch's rows), elsewhere the reference. With `fusion` (only where
    int4_gemv_takes): the tensor-core GEMV or the packed-fp16 one-row kernel, doing the fusion's work in
    the same launch."""
    if fusion is not None and _mma_gemv_takes(x, packed, scale, zero, group_size):
        return _mma_gemv().w4a16_gemv_mma(x, packed, scale, zero, group_size, bias, fusion)
    if fusion is not None:
        w4a16_skinny = triton_kernel("skinny_gemm", "w4a16_skinny")
        return w4a16_skinny(x, packed, scale, zero, group_size, bias, fusion=fusion)
    gemm = triton_kernel("int4_gemm", "w4a16_linear") if x.is_cuda else None
    return (gemm or w4a16_gemm)(x, packed, scale, zero, group_size, bias)


def _mma_gemv():
    """kernels/w4a16_gemv_cuda (the tensor-core INT4 GEMV) where the GPU kernels import, else None."""
    if triton_kernel("w4a16_gemv_cuda", "takes") is None:
        return None
    from tokenmill.kernels import w4a16_gemv_cuda

    return w4a16_gemv_cuda


def _mma_gemv_takes(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> bool:
    module = _mma_gemv() if x.is_cuda else None
    return module is not None and module.takes(x, packed, scale, zero, group_size)


def int4_gemv_takes(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int
) -> bool:
    """Whether int4_matmul sends x's rows to a kernel that can do a GemvFusion's work in the same launch:
    the tensor-core GEMV (kernels/w4a16_gemv_cuda.py's takes) or the packed-fp16 one-row kernel
    (skinny_gemm's packed_kernel_takes)."""
    if not x.is_cuda or group_size % PACK or not x.numel():
        return False
    if _mma_gemv_takes(x, packed, scale, zero, group_size):
        return True
    takes = triton_kernel("skinny_gemm", "packed_kernel_takes")
    return takes is not None and takes(x.dtype, x.numel() // x.shape[-1])


def checkpoint_rows(layer: nn.Module, shard_id: ShardId, output_size: int) -> int:
    """How many output rows the checkpoint's tensor for this layer (or this part of a fused one) has."""
    if hasattr(layer, "total_num_kv_heads"):  # QKV: the checkpoint's heads, before any replication
        kv = layer.total_num_kv_heads * layer.head_size
        sizes = {"q": layer.total_num_heads * layer.head_size, "k": kv, "v": kv}
        return sizes[shard_id] if shard_id is not None else sum(sizes.values())
    if shard_id is not None:
        return layer.output_sizes[shard_id]
    return output_size


def add_weight_shape(layer: nn.Module, input_size: int) -> None:
    """Register compressed-tensors' `weight_shape` ([N, K] of a packed weight) on the layer, checked as it
    loads against the layer's input_size (the checkpoint's whole K, before any tensor-parallel split)."""

    def check_shape(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if loaded.numel() != 2 or int(loaded.reshape(-1)[1]) != input_size:
            raise ValueError(f"weight_shape {loaded.tolist()} does not have {input_size} input columns")

    shape = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    shape.weight_loader, shape.output_dim, shape.input_dim = check_shape, None, None
    layer.register_parameter("weight_shape", shape)


def add_group_index(layer: nn.Module, name: str, columns: int, field: str, group: int = 0) -> None:
    """Register `name` (a checkpoint's g_idx: each input column's group, [K]) on a 4-bit layer: kept as it
    loads (a fused layer's parts, which share their input, must agree) for order_input_columns. A
    row-parallel layer under tensor parallelism takes one in order only (groups of `group` columns in a
    row: nothing to reorder, and each rank's slice whole groups)."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if tuple(loaded.shape) != (columns,):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected ({columns},)")
        check_dtype(torch.int64, loaded)
        loaded = loaded.to(torch.int64).cpu()
        earlier = getattr(layer, "group_index", None)
        if earlier is not None and not torch.equal(earlier, loaded):
            raise ValueError(
                f"{name} differs between the parts of one fused layer ({field}): they read the same "
                "input, which tokenmill reorders once for all of them"
            )
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            if group > 0 and torch.equal(loaded, torch.arange(columns) // group):
                return
            raise ValueError(
                f"{field} (input columns quantized out of order) with --tensor-parallel-size > 1 is not "
                f"supported (the row-parallel layers' {name})"
            )
        layer.group_index = loaded

    param = nn.Parameter(torch.zeros(0, dtype=torch.int32), requires_grad=False)
    param.weight_loader, param.output_dim, param.input_dim = load, None, None
    layer.register_parameter(name, param)


def order_input_columns(layer: nn.Module, packed_name: str, field: str) -> None:
    """Where a checkpoint quantized the input columns in an order of its own (GPTQ desc_act,
    compressed-tensors actorder "group": column k's group is g_idx[k]), the packed weight's columns are
    sorted by group once loaded, so that groups are contiguous again, and `input_order` gathers the
    activations' columns the same way before each matmul: x W^T = x[:, order] W[:, order]^T."""
    group_index = getattr(layer, "group_index", None)
    if group_index is None:
        return
    del layer.group_index
    group = layer.int4_group_size
    in_order = torch.arange(group_index.numel()) // group
    if torch.equal(group_index, in_order):
        return
    order = torch.sort(group_index, stable=True).indices
    if not torch.equal(group_index[order], in_order):
        raise ValueError(f"{field}: g_idx does not put {group} input columns in each group")
    packed = getattr(layer, packed_name)
    if packed.dtype == torch.int8:  # GPTQ's 8-bit: a value a byte, the columns sorted as they are
        packed.data = packed.data[:, order.to(packed.device)].contiguous()
    else:
        values = unpack_int4(packed.data, group_index.numel())[:, order.to(packed.device)]
        packed.data = pack_int4(values)
    layer.input_order = order.to(packed.device)


def dequantize_in_order(
    layer: nn.Module, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
) -> torch.Tensor:
    """A 4-bit (or GPTQ 8-bit: int8 `packed`) layer's weight [N, K] in fp32, its input columns back in the
    checkpoint's order where order_input_columns sorted them."""
    columns = layer.int4_in_features
    if packed.dtype == torch.int8:
        weight = dequantize_8bit_groups(packed, scale, zero, layer.int4_group_size, torch.float32)
    else:
        weight = dequantize_int4(packed, scale, zero, layer.int4_group_size, columns, torch.float32)
    order = getattr(layer, "input_order", None)
    if order is None:
        return weight
    unsorted = torch.empty_like(weight)
    unsorted[:, order] = weight
    return unsorted


def ordered_input(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    order = getattr(layer, "input_order", None)
    return x if order is None else x.index_select(-1, order)


def _param(
    data: torch.Tensor, output_dim: int | None, input_dim: int | None, loader: WeightLoader
) -> nn.Parameter:
    param = nn.Parameter(data, requires_grad=False)
    param.output_dim, param.input_dim, param.weight_loader = output_dim, input_dim, loader
    return param


def quantize_linear_int4(layer: nn.Module, group_size: int = 128) -> None:
    """Online W4A16: replace a loaded linear's `weight` with symmetric round-to-nearest 4-bit groups
    (scale = the group's largest magnitude / 7; the last group may be shorter than group_size)."""
    columns = layer.weight.shape[1]
    packed, scale = quantize_int4_symmetric(layer.weight.data, group_size)
    del layer.weight
    layer.register_parameter("weight_packed", nn.Parameter(packed, requires_grad=False))
    layer.register_parameter("weight_scale", nn.Parameter(scale, requires_grad=False))
    layer.int4_group_size = group_size
    layer.int4_in_features = columns
    layer.quant_method = Int4W4A16LinearMethod(group_size, symmetric=True)
