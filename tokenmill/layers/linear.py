"""Linear layers that own their weights (vLLM's names and sharding): each module holds one tensor-parallel
rank's shard and cuts it from the full checkpoint tensor in its weight_loader. There is no
torch.distributed yet: a module computes its own rank's part; gathering or all-reducing is the caller's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from tokenmill import distributed
from tokenmill.kernels import GemvFusion, RowQuant, ScaledRows, triton_kernel
from tokenmill.layers.dense import dense_gemv_takes, dense_linear
from tokenmill.layers.sharding import ShardId, WeightLoader, divide, heads_per_rank, load_shard, split_fused


class LinearMethodBase(ABC):
    """How a linear layer stores and applies its weight: the seam a quantized method (fp8, int4) plugs
    into. create_weights registers the layer's parameters, each carrying `weight_loader` and the dims it
    is sharded along (`output_dim`, `input_dim`; None where every rank holds that dim whole)."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None,
        weight_loader: WeightLoader,
    ) -> None: ...

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def apply_scaled(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | ScaledRows:
        """apply, or where the method leaves its product's scales to the launch that reads it (a W8A8
        method at cuBLAS's sizes: fp8.SCALES_AFTER), that product unscaled (ScaledRows). Only callers
        whose next launch takes ScaledRows (an RMSNorm, the gated activation) ask for it."""
        return self.apply(layer, x, bias)

    def after_loading(self, layer: nn.Module) -> None:
        """Once every checkpoint tensor is in (or dummy weights): what needs all of them at once."""
        return None

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [N, K] in fp32, as its stored tensors mean it (once after_loading ran): what
        a quantized checkpoint's MoE experts are turned into as they load (quantization/moe_experts.py)."""
        raise NotImplementedError(f"{type(self).__name__} has no dequantized weight")

    def row_quant(self, layer: nn.Module, x: torch.Tensor) -> RowQuant | None:
        """How apply quantizes activations like x a row (token) at a time before its product (FP8 and INT8
        W8A8 with dynamic or static activation scales), where it does: then apply also takes them already
        quantized so (QuantizedRows), by the launch that made them (fused_linear.row_quant_for). None: apply
        takes x as it is (weight-only methods, and the W8A8 ones at the decode sizes their one-row
        kernels multiply 16-bit activations at)."""
        return None

    def gemv_takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether `gemv` takes activations like x (their rows, dtype and device): a method whose one-row
        GEMV does GemvFusion's work says so; none by default."""
        return False

    def gemv(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
    ) -> torch.Tensor:
        """apply's product with `fusion`'s work done in the same launch (only where gemv_takes)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused one-row GEMV")


class UnquantizedLinearMethod(LinearMethodBase):
    """One dense weight [output_size_per_partition, input_size_per_partition] in params_dtype."""

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
        shape = (sum(output_partition_sizes), input_size_per_partition)
        weight = nn.Parameter(torch.empty(shape, dtype=params_dtype), requires_grad=False)
        weight.output_dim, weight.input_dim, weight.weight_loader = 0, 1, weight_loader
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return layer.weight.float()

    def gemv_takes(self, layer: nn.Module, x: torch.Tensor) -> bool:
        return dense_gemv_takes(x, layer.weight)

    def gemv(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, fusion: GemvFusion
    ) -> torch.Tensor:
        return triton_kernel("skinny_gemm", "dense_gemv")(x, layer.weight, bias, fusion=fusion)


# While a model is built for a quantized checkpoint: makes the method each linear layer gets by default.
_linear_method_factory: ContextVar[Callable[[], LinearMethodBase] | None] = ContextVar(
    "linear_method_factory", default=None
)


@contextmanager
def default_linear_method(factory: Callable[[], LinearMethodBase] | None) -> Iterator[None]:
    """Linear layers built inside get factory() as their method (None: unquantized), so a model builds
    its quantized parameters in their stored shapes without knowing the scheme."""
    token = _linear_method_factory.set(factory)
    try:
        yield
    finally:
        _linear_method_factory.reset(token)


def reset_to_unquantized(layer: LinearBase) -> None:
    """Rebuild a layer's weight in the model dtype (a layer the checkpoint's ignore list names)."""
    for name in [n for n, _ in layer.named_parameters(recurse=False) if n != "bias"]:
        delattr(layer, name)
    layer.quant_method = UnquantizedLinearMethod()
    layer.quant_method.create_weights(
        layer,
        layer.input_size_per_partition,
        layer.output_partition_sizes,
        layer.input_size,
        layer.output_size,
        layer.params_dtype,
        weight_loader=layer.weight_loader,
    )


class LinearBase(nn.Module):
    """What the four layers share: the rank, the quant method, and the creation of weight and bias."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_size: int | None,
        tp_rank: int | None,
        params_dtype: torch.dtype | None,
        quant_method: LinearMethodBase | None,
    ) -> None:
        super().__init__()
        tp_size = distributed.tp_size() if tp_size is None else tp_size
        tp_rank = distributed.tp_rank() if tp_rank is None else tp_rank
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1} (tp_size {tp_size}).")
        self.input_size, self.output_size = input_size, output_size
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.params_dtype = params_dtype
        factory = _linear_method_factory.get()
        self.quant_method = quant_method or (factory() if factory is not None else UnquantizedLinearMethod())

    def _create_weights(
        self, input_size_per_partition: int, output_partition_sizes: list[int], bias: bool, bias_sharded: bool
    ) -> None:
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.quant_method.create_weights(
            self,
            input_size_per_partition,
            output_partition_sizes,
            self.input_size,
            self.output_size,
            self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if not bias:
            self.register_parameter("bias", None)
            return
        size = self.output_size_per_partition if bias_sharded else self.output_size
        self.bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        self.bias.output_dim = 0 if bias_sharded else None
        self.bias.input_dim, self.bias.weight_loader = None, self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def forward_scaled(self, x: torch.Tensor) -> torch.Tensor | ScaledRows:
        """forward, or its product with the scales left to the launch after it (apply_scaled), where the
        layer is whole on this rank (a row-parallel shard's partial sums are all-reduced first)."""
        if self.tp_size > 1:
            return self(x)
        return self.quant_method.apply_scaled(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """y = x W^T + b with W's rows (the output features) split: rank r holds output features
    [r * output_size / tp_size, (r + 1) * output_size / tp_size) of W and b and returns that slice of y.
    `output_sizes` names the logical outputs a fused layer concatenates; each is split on its own."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        *,
        output_sizes: list[int] | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__(input_size, output_size, tp_size, tp_rank, params_dtype, quant_method)
        self.output_sizes = output_sizes or [output_size]
        partition_sizes = [divide(size, self.tp_size, "an output size") for size in self.output_sizes]
        self._create_weights(input_size, partition_sizes, bias, bias_sharded=True)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        load_shard(param.data, loaded_weight, param.output_dim, self.tp_rank, self.tp_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input in one matmul (the MLP's gate and up): rank r's weight
    is [gate_r; up_r], its slice of each output in order. Checkpoint shard ids are output indices."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__(
            input_size,
            sum(output_sizes),
            bias,
            output_sizes=list(output_sizes),
            tp_size=tp_size,
            tp_rank=tp_rank,
            params_dtype=params_dtype,
            quant_method=quant_method,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is None:  # a checkpoint that stores the outputs already fused
            for index, chunk in enumerate(split_fused(loaded_weight, param.output_dim, self.output_sizes)):
                self.weight_loader(param, chunk, index)
            return
        if shard_id not in range(len(self.output_sizes)):
            raise ValueError(f"shard id {shard_id!r} is not an output index below {len(self.output_sizes)}")
        offset = sum(self.output_partition_sizes[:shard_id])
        dest = param.data.narrow(param.output_dim, offset, self.output_partition_sizes[shard_id])
        load_shard(dest, loaded_weight, param.output_dim, self.tp_rank, self.tp_size)


class QKVParallelLinear(ColumnParallelLinear):
    """The attention's q, k and v projections in one matmul: rank r's weight is [q_r; k_r; v_r]. Query
    heads split evenly across ranks; KV heads split too, or, when there are fewer KV heads than ranks,
    each is replicated on tp_size / num_kv_heads consecutive ranks. Checkpoint shard ids: "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = distributed.tp_size() if tp_size is None else tp_size
        num_heads, num_kv_heads, num_kv_head_replicas = heads_per_rank(
            total_num_heads, total_num_kv_heads, tp_size
        )
        # Per-rank sizes times tp_size, so that a replicated KV head counts once per rank holding it.
        q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
        output_sizes = [q_size * tp_size, kv_size * tp_size, kv_size * tp_size]
        super().__init__(
            hidden_size,
            sum(output_sizes),
            bias,
            output_sizes=output_sizes,
            tp_size=tp_size,
            tp_rank=tp_rank,
            params_dtype=params_dtype,
            quant_method=quant_method,
        )
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.num_kv_head_replicas = num_kv_head_replicas

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        if shard_id is None:  # a checkpoint that stores q, k and v already fused
            kv_size = self.total_num_kv_heads * self.head_size
            full_sizes = [self.total_num_heads * self.head_size, kv_size, kv_size]
            for name, chunk in zip("qkv", split_fused(loaded_weight, param.output_dim, full_sizes)):
                self.weight_loader(param, chunk, name)
            return
        q_size, kv_size = self.output_partition_sizes[:2]
        # Ranks holding the same KV heads load the same slice: the KV tensor has one slice per group.
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        num_kv_shards = self.tp_size // self.num_kv_head_replicas
        shards = {
            "q": (0, q_size, self.tp_rank, self.tp_size),
            "k": (q_size, kv_size, kv_rank, num_kv_shards),
            "v": (q_size + kv_size, kv_size, kv_rank, num_kv_shards),
        }
        if shard_id not in shards:
            raise ValueError(f"shard id {shard_id!r} is not 'q', 'k' or 'v'")
        offset, size, shard_rank, num_shards = shards[shard_id]
        dest = param.data.narrow(param.output_dim, offset, size)
        load_shard(dest, loaded_weight, param.output_dim, shard_rank, num_shards)


class RowParallelLinear(LinearBase):
    """y = x W^T + b with W's columns (the input features) split: rank r takes its slice of x's features
    (a column-parallel layer's output) and returns a partial y; the ranks' partials sum to y (an
    all-reduce, once there is torch.distributed). Every rank holds the whole bias but only rank 0 adds
    it, so the sum adds it once."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        *,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        params_dtype: torch.dtype | None = None,
        quant_method: LinearMethodBase | None = None,
    ) -> None:
        super().__init__(input_size, output_size, tp_size, tp_rank, params_dtype, quant_method)
        input_size_per_partition = divide(input_size, self.tp_size, "input_size")
        self._create_weights(input_size_per_partition, [output_size], bias, bias_sharded=False)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        load_shard(param.data, loaded_weight, param.input_dim, self.tp_rank, self.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return distributed.all_reduce(
            self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        )
