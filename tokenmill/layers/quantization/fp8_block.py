"""Fine-grained FP8 checkpoints as transformers' FP8 integration saves them (DeepSeek-V3, Qwen3-FP8):
`quant_method: fp8` in config.json with `weight_block_size` [128, 128] and `activation_scheme: dynamic`.
Each linear stores `weight` in e4m3 and `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)], one scale
per 128 x 128 block (w = weight * scale_inv); activations are quantized at run time per token and per
128 input columns.

Activations are quantized per token group (torch ops), then the block-scaled GEMM runs: on CUDA the
Triton kernel (kernels/fp8_block_gemm.py: FP8 tensor cores where the GPU has them, the scales applied
per K block), elsewhere the reference (dequantize, multiply in fp32: exact).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.kernels import QuantizedRows, RowQuant, quant_reference, triton_kernel
from tokenmill.layers.linear import (
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tokenmill.layers.quantization.compressed_tensors import not_converted
from tokenmill.layers.quantization.fp8 import FP8_DTYPE, quantize_per_row
from tokenmill.layers.quantization.per_row_scaled import CompressedTensorsFp8LinearMethod
from tokenmill.layers.sharding import ShardId, WeightLoader, check_columns_split, check_dtype, load_shard


class Fp8BlockConfig:
    """`quant_method: fp8` as transformers writes it (weight_block_size), or without weight_block_size as
    AutoFP8 wrote it: e4m3 weights with one `weight_scale` per tensor, activations per token (dynamic)
    or per tensor (static, `input_scale`), run by compressed-tensors' FP8 method (vLLM's Fp8Config reads
    both)."""

    def __init__(self, config: dict) -> None:
        where = "quantization_config"
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{where}.fmt {fmt!r} is not supported (supported: e4m3).")
        scheme = config.get("activation_scheme", "dynamic")
        block = config.get("weight_block_size")
        # AutoFP8 names its unquantized layers ignored_layers; transformers, modules_to_not_convert.
        self.ignore_key = "ignored_layers" if config.get("ignored_layers") else "modules_to_not_convert"
        self.ignore: list[str] = list(config.get(self.ignore_key) or [])
        if block is None:
            if scheme not in ("dynamic", "static"):
                raise ValueError(
                    f"{where}.activation_scheme {scheme!r} is not supported (supported: dynamic, static)."
                )
            self.input_scheme: str | None = "token" if scheme == "dynamic" else "tensor"
            self.uses_fp8 = True  # FP8 activations, as compressed-tensors' FP8 checkpoints
            return
        if scheme != "dynamic":
            raise ValueError(
                f"{where}.activation_scheme {scheme!r} is not supported with weight_block_size "
                "(supported: dynamic)."
            )
        if not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ValueError(
                f"{where}.weight_block_size {block!r} is not supported (supported: [rows, columns], e.g. "
                "[128, 128], or none for one scale per tensor)."
            )
        self.block_n, self.block_k = block
        self.input_scheme = None
        self.uses_fp8 = False  # the reference dequantizes: no FP8 tensor cores needed

    def linear_method(self) -> LinearMethodBase:
        if self.input_scheme is not None:
            return CompressedTensorsFp8LinearMethod(self.input_scheme)
        return Fp8BlockLinearMethod(self.block_n, self.block_k)

    def is_ignored(self, prefix: str) -> bool:
        return not_converted(prefix, self.ignore, self.ignore_key)


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/group)]): each token's columns in groups, each
    group a row of the per-row quantizer (one Triton launch on CUDA)."""
    m, k = x.shape
    groups = math.ceil(k / group)
    if k % group:
        x = torch.nn.functional.pad(x, (0, groups * group - k))
    q, scale = quantize_per_row(x.reshape(m * groups, group))
    return q.reshape(m, groups * group)[:, :k], scale.reshape(m, groups)


def fp8_block_row_quant(block_k: int) -> RowQuant | None:
    """What fp8_block_linear quantizes its input to (per token, per group of block_k columns), for the
    launch that makes that input to do in its stores; None for a group that is not a power of two (the
    quantizing launches take groups of whole power-of-two blocks)."""
    if block_k & (block_k - 1):
        return None
    return RowQuant(False, None, lambda x, _static: quantize_per_token_group(x, block_k), group=block_k)


def fp8_block_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y = x W^T + b for W in e4m3 blocks of block_n x block_k with their scales; x quantized per token
    and per group of block_k columns here, or already so by the launch that made it (QuantizedRows,
    where fp8_block_row_quant asked for it)."""
    if isinstance(x, QuantizedRows):
        shape, dtype, x_q, x_scale = x.shape, x.dtype, x.values, x.scale
    else:
        shape, dtype = x.shape, x.dtype
        x_q, x_scale = quantize_per_token_group(x.reshape(-1, shape[-1]), block_k)
    n = weight.shape[0]
    gemm = quant_reference.fp8_block_gemm
    if x_q.is_cuda and block_k >= 16 and not block_k & (block_k - 1):
        gemm = triton_kernel("fp8_block_gemm", "fp8_block_gemm") or gemm
    y = gemm(x_q, x_scale, weight, scale_inv, block_n, block_k, dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], n)


class Fp8BlockLinearMethod(LinearMethodBase):
    def __init__(
        self,
        block_n: int,
        block_k: int,
        scale_name: str = "weight_scale_inv",
        field: str = "quantization_config.weight_block_size",
    ) -> None:
        """scale_name: the block scales' tensor name (compressed-tensors' FP8_BLOCK calls it
        weight_scale; the same numbers, w = weight * scale). field: the config field of the block, for
        errors."""
        self.block_n, self.block_k, self.scale_name, self.field = block_n, block_k, scale_name, field
        self._row_quant = fp8_block_row_quant(block_k)

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
        fused = isinstance(layer, (QKVParallelLinear, MergedColumnParallelLinear))
        row_parallel = isinstance(layer, RowParallelLinear)
        # A fused layer's parts each have their own scale blocks. Where a part is not a whole number of
        # blocks (KV heads of 2 x 80 rows against blocks of 128), its scales are kept in finer blocks that
        # every part is a whole number of, each holding its original block's scale. Split over ranks, a
        # rank's rows of a part start where its slice does, so every part counts (last included).
        split = not row_parallel and layer.tp_size > 1
        parts = output_partition_sizes if split else output_partition_sizes[:-1] if fused else []
        block_n = math.gcd(self.block_n, *parts)
        layer.fp8_block_n = block_n
        if row_parallel:
            what = f"{self.field} [{self.block_n}, {self.block_k}] (blocks of {self.block_k} columns)"
            check_columns_split(columns, self.block_k, layer.tp_size, what)
        weight = nn.Parameter(torch.empty(rows, columns, dtype=FP8_DTYPE), requires_grad=False)
        weight.output_dim, weight.input_dim, weight.weight_loader = 0, 1, weight_loader
        layer.register_parameter("weight", weight)
        # One scale per block of rows: a fused layer's parts each start on a block boundary (above), so
        # the parts' scale rows concatenate like their weight rows, in units of blocks.
        block_rows = [math.ceil(size / block_n) for size in output_partition_sizes]
        scale = nn.Parameter(
            torch.empty(sum(block_rows), math.ceil(columns / self.block_k), dtype=torch.float32),
            requires_grad=False,
        )
        scale.output_dim, scale.input_dim = 0, 1 if row_parallel else None
        offsets = [sum(block_rows[:i]) for i in range(len(block_rows))]

        def load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            check_dtype(param.dtype, loaded)
            if row_parallel:  # this rank's columns: whole blocks (above)
                load_shard(param.data, loaded, 1, layer.tp_rank, layer.tp_size)
                return
            shard_rank, num_shards = layer.tp_rank, layer.tp_size
            if not fused or shard_id is None:
                if fused and num_shards > 1:
                    raise ValueError("a fused layer's scales stored fused cannot be split over ranks")
                dest, size = param.data, rows
            else:
                index = "qkv".index(shard_id) if isinstance(shard_id, str) else int(shard_id)
                dest = param.data.narrow(0, offsets[index], block_rows[index])
                size = output_partition_sizes[index]
                if shard_id in ("k", "v"):  # KV heads replicated over ranks: one slice per group of them
                    shard_rank //= layer.num_kv_head_replicas
                    num_shards //= layer.num_kv_head_replicas
            if num_shards == 1 and loaded.shape == dest.shape:
                dest.copy_(loaded)
                return
            expected = (math.ceil(size * num_shards / self.block_n), dest.shape[1])
            if tuple(loaded.shape) != expected:
                raise ValueError(f"shape {tuple(loaded.shape)} does not match the expected {expected}")
            # Each of this rank's (finer) blocks takes the scale of the stored block its first row is in.
            first_rows = shard_rank * size + torch.arange(dest.shape[0]) * block_n
            dest.copy_(loaded[first_rows // self.block_n])

        scale.weight_loader = load_scale
        layer.register_parameter(self.scale_name, scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # Row r of a fused weight finds its scale block at r // block_n: every part but the last starts
        # on a block boundary (of the layer's own blocks, create_weights).
        scale = getattr(layer, self.scale_name)
        return fp8_block_linear(x, layer.weight, scale, layer.fp8_block_n, self.block_k, bias)

    def row_quant(self, layer: nn.Module, x: torch.Tensor) -> RowQuant | None:
        return self._row_quant  # every batch size quantizes its input (no one-row kernel here)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        n, k = layer.weight.shape
        scale = getattr(layer, self.scale_name).repeat_interleave(layer.fp8_block_n, dim=0)[:n]
        return layer.weight.float() * scale.repeat_interleave(self.block_k, dim=1)[:, :k]
