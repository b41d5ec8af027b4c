"""FP8 and INT8 checkpoint weights with one scale per output row at run time, the linear method of
compressed-tensors' FP8 and INT8 schemes and of the other checkpoints stored the same way (AutoFP8's and
Model Optimizer's FP8, the MoE experts'): a per-tensor scale, which a fused layer has one of for each part
(q, k, v; gate, up), is spread over that part's rows as it loads, so the fused matmul needs no
requantization; a static input scale of a fused layer is the largest of its parts' scales."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels import GemvFusion, RowQuant, ScaledRows, skinny_kernel
from tokenmill.kernels.quant_reference import w8a16_gemm
from tokenmill.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.layers.quantization.fp8 import FP8_DTYPE, fp8_gemv, fp8_gemv_takes, fp8_linear, fp8_row_quant
from tokenmill.layers.quantization.int4 import add_weight_shape
from tokenmill.layers.quantization.int8 import int8_linear, int8_row_quant, unpack_int8
from tokenmill.layers.sharding import ShardId, WeightLoader


class CompressedTensorsFp8LinearMethod(LinearMethodBase):
    weight_dtype = FP8_DTYPE

    def __init__(self, input_scheme: str | None) -> None:
        self.input_scheme = input_scheme

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
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(
            torch.empty(rows, input_size_per_partition, dtype=self.weight_dtype), requires_grad=False
        )
        weight.output_dim, weight.input_dim, weight.weight_loader = 0, 1, weight_loader
        layer.register_parameter("weight", weight)
        # One scale per output row; row-parallel layers hold every row (their input is what is split).
        scale = nn.Parameter(torch.empty(rows, 1, dtype=torch.float32), requires_grad=False)
        scale.output_dim = None if isinstance(layer, RowParallelLinear) else 0
        scale.input_dim = None

        def load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            if loaded.numel() == 1:  # per-tensor: spread over the rows of this part
                loaded = loaded.reshape(1, 1).float().expand(_part_rows(layer, shard_id), 1)
            weight_loader(param, loaded.reshape(-1, 1).float(), shard_id)

        scale.weight_loader = load_scale
        layer.register_parameter("weight_scale", scale)
        if self.input_scheme == "tensor":
            input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            input_scale.output_dim = input_scale.input_dim = None

            def load_input_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
                if loaded.numel() != 1:
                    raise ValueError(f"input_scale has {loaded.numel()} values; a per-tensor scale has 1")
                param.data.copy_(torch.maximum(param.data, loaded.reshape(1).float().to(param.device)))

            input_scale.weight_loader = load_input_scale
            layer.register_parameter("input_scale", input_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.input_scheme == "token":
            return fp8_linear(x, layer.weight, layer.weight_scale, bias)
        if self.input_scheme == "tensor":
            return fp8_linear(x, layer.weight, layer.weight_scale, bias, layer.input_scale)
        # Weight-only: the skinny kernel for decode-sized batches on CUDA, else its reference (dequantize
        # to the activations' dtype and multiply there).
        gemm = skinny_kernel(x, "w8a16_skinny") or w8a16_gemm
        return gemm(x, layer.weight, layer.weight_scale, bias)

    def apply_scaled(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | ScaledRows:
        if self.weight_dtype != FP8_DTYPE or self.input_scheme is None:
            return self.apply(layer, x, bias)
        input_scale = layer.input_scale if self.input_scheme == "tensor" else None
        return fp8_linear(x, layer.weight, layer.weight_scale, bias, input_scale, scales_after=True)

    def row_quant(self, layer: nn.Module, x: torch.Tensor) -> RowQuant | None:
        if self.input_scheme is None:  # weight-only
            return None
        return self.row_quant_for_scale(x, layer.input_scale if self.input_scheme == "tensor" else None)

    row_quant_for_scale = staticmethod(fp8_row_quant)  # the int8 method's own: int8_row_quant

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float() * layer.weight_scale

    def gemv_takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return fp8_gemv_takes(x)  # every scheme takes the one-row kernel at these rows (fp8_linear's too)

    def gemv(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
    ) -> torch.Tensor:
        return fp8_gemv(x, layer.weight, layer.weight_scale, bias, fusion)


class CompressedTensorsInt8LinearMethod(CompressedTensorsFp8LinearMethod):
    """INT8 weights [N, K] with a scale per row (per-tensor scales spread over their part's rows), the FP8
    method's layout and loaders with int8 in place of e4m3; int8.py's int8_linear runs them. packed: the
    checkpoint stores them as compressed-tensors' 8-bit `weight_packed` words (with `weight_shape`),
    unpacked to int8 as each loads."""

    weight_dtype = torch.int8

    def __init__(self, input_scheme: str | None, packed: bool) -> None:
        super().__init__(input_scheme)
        self.packed = packed

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
        super().create_weights(
            layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
            weight_loader,
        )  # fmt: skip
        if not self.packed:
            return
        # The int8 tensor takes the checkpoint's name; after_loading gives it the layer's.
        weight = layer.weight
        del layer.weight

        def load_packed(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            weight_loader(param, unpack_int8(loaded, input_size), shard_id)

        weight.weight_loader = load_packed
        layer.register_parameter("weight_packed", weight)
        add_weight_shape(layer, input_size)

    def after_loading(self, layer: nn.Module) -> None:
        if self.packed and hasattr(layer, "weight_packed"):
            weight = layer.weight_packed
            del layer.weight_packed, layer.weight_shape
            layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        input_scale = layer.input_scale if self.input_scheme == "tensor" else None
        return int8_linear(x, layer.weight, layer.weight_scale, bias, self.input_scheme, input_scale)

    row_quant_for_scale = staticmethod(int8_row_quant)


def _part_rows(layer: nn.Module, shard_id: ShardId) -> int:
    """Rows of the whole checkpoint tensor that shard_id names (before tensor-parallel splitting)."""
    if isinstance(layer, QKVParallelLinear) and shard_id in ("q", "k", "v"):
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear) and shard_id is not None:
        return layer.output_sizes[int(shard_id)]
    return layer.output_size
