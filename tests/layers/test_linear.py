"""Tensor-parallel linear layers: every rank loads the same full checkpoint tensor through its
weight_loader; the shards must rebuild the full weight, and the ranks' outputs the unsharded output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import (
    ColumnParallelLinear,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)

TP_SIZES = [1, 2, 4]
NUM_TOKENS = 5


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def load(layer: nn.Module, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_column_parallel_splits_the_output_dim(tp_size: int) -> None:
    weight, bias, x = randn(36, 37, seed=1), randn(36, seed=2), randn(NUM_TOKENS, 37, seed=3)
    ranks = [ColumnParallelLinear(37, 36, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    for layer in ranks:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        assert layer.weight.shape == (36 // tp_size, 37)
    torch.testing.assert_close(torch.cat([layer.weight for layer in ranks]), weight, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([layer.bias for layer in ranks]), bias, rtol=0, atol=0)
    outputs = torch.cat([layer(x) for layer in ranks], dim=-1)
    torch.testing.assert_close(outputs, F.linear(x, weight, bias))


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_row_parallel_splits_the_input_dim_and_adds_the_bias_once(tp_size: int) -> None:
    weight, bias, x = randn(23, 36, seed=1), randn(23, seed=2), randn(NUM_TOKENS, 36, seed=3)
    ranks = [RowParallelLinear(36, 23, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    for layer in ranks:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
        assert layer.weight.shape == (23, 36 // tp_size)
        torch.testing.assert_close(layer.bias, bias, rtol=0, atol=0)  # every rank holds it whole
    torch.testing.assert_close(torch.cat([layer.weight for layer in ranks], dim=1), weight, rtol=0, atol=0)
    x_slices = x.chunk(tp_size, dim=-1)
    partials = [layer(x_slice) for layer, x_slice in zip(ranks, x_slices)]
    torch.testing.assert_close(sum(partials), F.linear(x, weight, bias))
    for layer, x_slice, partial in zip(ranks[1:], x_slices[1:], partials[1:]):
        torch.testing.assert_close(partial, F.linear(x_slice, layer.weight))


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_merged_column_holds_gate_then_up_per_rank(tp_size: int) -> None:
    gate, up, x = randn(20, 37, seed=1), randn(44, 37, seed=2), randn(NUM_TOKENS, 37, seed=3)
    gate_bias, up_bias = randn(20, seed=4), randn(44, seed=5)
    ranks = [MergedColumnParallelLinear(37, [20, 44], tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    for layer in ranks:
        for shard_id, (weight, bias) in enumerate([(gate, gate_bias), (up, up_bias)]):
            load(layer, "weight", weight, shard_id)
            load(layer, "bias", bias, shard_id)
    gate_rows, up_rows = 20 // tp_size, 44 // tp_size
    for rank, layer in enumerate(ranks):
        expected = torch.cat([gate.chunk(tp_size)[rank], up.chunk(tp_size)[rank]])
        torch.testing.assert_close(layer.weight, expected, rtol=0, atol=0)
        expected_bias = torch.cat([gate_bias.chunk(tp_size)[rank], up_bias.chunk(tp_size)[rank]])
        torch.testing.assert_close(layer.bias, expected_bias, rtol=0, atol=0)
    gate_out, up_out = zip(*(layer(x).split([gate_rows, up_rows], dim=-1) for layer in ranks))
    torch.testing.assert_close(torch.cat(gate_out, dim=-1), F.linear(x, gate, gate_bias))
    torch.testing.assert_close(torch.cat(up_out, dim=-1), F.linear(x, up, up_bias))


@pytest.mark.parametrize("tp_size", TP_SIZES)
def test_merged_column_loads_a_fused_checkpoint_tensor_like_its_shards(tp_size: int) -> None:
    gate, up = randn(20, 37, seed=1), randn(44, 37, seed=2)
    for rank in range(tp_size):
        from_shards = MergedColumnParallelLinear(37, [20, 44], bias=False, tp_size=tp_size, tp_rank=rank)
        fused = MergedColumnParallelLinear(37, [20, 44], bias=False, tp_size=tp_size, tp_rank=rank)
        load(from_shards, "weight", gate, 0)
        load(from_shards, "weight", up, 1)
        load(fused, "weight", torch.cat([gate, up]))
        torch.testing.assert_close(fused.weight, from_shards.weight, rtol=0, atol=0)


# (num_heads, num_kv_heads, head_size) on odd head sizes: GQA 3, MHA, GQA 4 (KV heads replicated twice
# at tp_size 4) and MQA (one KV head, replicated on every rank).
QKV_SHAPES = [(12, 4, 7), (4, 4, 9), (8, 2, 5), (8, 1, 5)]


@pytest.mark.parametrize("tp_size", TP_SIZES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", QKV_SHAPES)
def test_qkv_splits_heads_and_replicates_kv_heads_when_fewer_than_ranks(
    tp_size: int, num_heads: int, num_kv_heads: int, head_size: int
) -> None:
    hidden = 29
    q, k, v = (
        randn(n * head_size, hidden, seed=s) for s, n in enumerate([num_heads, num_kv_heads, num_kv_heads])
    )
    q_bias, k_bias, v_bias = (randn(t.shape[0], seed=10 + s) for s, t in enumerate([q, k, v]))
    x = randn(NUM_TOKENS, hidden, seed=20)
    ranks = [
        QKVParallelLinear(hidden, head_size, num_heads, num_kv_heads, tp_size=tp_size, tp_rank=r)
        for r in range(tp_size)
    ]
    for layer in ranks:
        for shard_id, weight, bias in [("q", q, q_bias), ("k", k, k_bias), ("v", v, v_bias)]:
            load(layer, "weight", weight, shard_id)
            load(layer, "bias", bias, shard_id)
    replicas = max(1, tp_size // num_kv_heads)
    num_kv_shards = tp_size // replicas
    assert all(layer.num_kv_head_replicas == replicas for layer in ranks)
    q_rows, kv_rows = num_heads * head_size // tp_size, num_kv_heads * head_size // num_kv_shards
    for rank, layer in enumerate(ranks):
        kv_shard = rank // replicas  # replicas of one KV head sit on consecutive ranks
        expected = torch.cat(
            [q.chunk(tp_size)[rank], k.chunk(num_kv_shards)[kv_shard], v.chunk(num_kv_shards)[kv_shard]]
        )
        torch.testing.assert_close(layer.weight, expected, rtol=0, atol=0)
        assert layer.weight.shape == (q_rows + 2 * kv_rows, hidden)
    q_out, k_out, v_out = zip(*(layer(x).split([q_rows, kv_rows, kv_rows], dim=-1) for layer in ranks))
    torch.testing.assert_close(torch.cat(q_out, dim=-1), F.linear(x, q, q_bias))
    distinct = range(0, tp_size, replicas)  # one rank of each group holding the same KV heads
    torch.testing.assert_close(torch.cat([k_out[r] for r in distinct], dim=-1), F.linear(x, k, k_bias))
    torch.testing.assert_close(torch.cat([v_out[r] for r in distinct], dim=-1), F.linear(x, v, v_bias))
    for rank in range(tp_size):
        torch.testing.assert_close(k_out[rank], k_out[rank - rank % replicas], rtol=0, atol=0)


def test_qkv_loads_a_fused_checkpoint_tensor_like_its_shards() -> None:
    q, k, v = randn(8 * 5, 29, seed=1), randn(2 * 5, 29, seed=2), randn(2 * 5, 29, seed=3)
    for rank in range(4):
        from_shards = QKVParallelLinear(29, 5, 8, 2, bias=False, tp_size=4, tp_rank=rank)
        fused = QKVParallelLinear(29, 5, 8, 2, bias=False, tp_size=4, tp_rank=rank)
        for shard_id, tensor in zip("qkv", [q, k, v]):
            load(from_shards, "weight", tensor, shard_id)
        load(fused, "weight", torch.cat([q, k, v]))
        torch.testing.assert_close(fused.weight, from_shards.weight, rtol=0, atol=0)


def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused() -> None:
    layer = ColumnParallelLinear(37, 36, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match=r"shape \(40, 37\) does not match the expected \(36, 37\)"):
        load(layer, "weight", torch.zeros(40, 37))
    row = RowParallelLinear(36, 23, tp_size=4, tp_rank=0)
    with pytest.raises(ValueError, match=r"shape \(23, 9\) does not match the expected \(23, 36\)"):
        load(row, "weight", torch.zeros(23, 9))  # a shard where the full tensor belongs
    qkv = QKVParallelLinear(29, 5, 8, 2, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"shape \(15, 29\) does not match the expected \(10, 29\)"):
        load(qkv, "weight", torch.zeros(15, 29), "k")
    with pytest.raises(ValueError, match="shard id 'o' is not 'q', 'k' or 'v'"):
        load(qkv, "weight", torch.zeros(10, 29), "o")
    merged = MergedColumnParallelLinear(37, [20, 44])
    with pytest.raises(ValueError, match="fused size 63 along dim 0 is not the expected 64"):
        load(merged, "weight", torch.zeros(63, 37))


def test_sizes_that_do_not_split_are_refused() -> None:
    with pytest.raises(ValueError, match=r"output size \(36\) is not divisible by tp_size \(8\)"):
        ColumnParallelLinear(37, 36, tp_size=8)
    with pytest.raises(ValueError, match=r"input_size \(37\) is not divisible by tp_size \(2\)"):
        RowParallelLinear(37, 36, tp_size=2)
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) is not divisible by tp_size \(2\)"):
        QKVParallelLinear(29, 5, 6, 3, tp_size=2)
    with pytest.raises(ValueError, match=r"tp_size \(4\) is not a multiple of num_kv_heads \(3\)"):
        QKVParallelLinear(29, 5, 12, 3, tp_size=4)
    with pytest.raises(ValueError, match="tp_rank 2 is outside 0..1"):
        RowParallelLinear(36, 23, tp_size=2, tp_rank=2)


def test_quantization_groups_that_do_not_split_name_the_field_and_the_flag() -> None:
    """A row-parallel layer's columns a rank against the checkpoint's groups or blocks."""
    from tokenmill.layers.quantization.compressed_tensors import CompressedTensorsConfig
    from tokenmill.layers.quantization.fp8_block import Fp8BlockLinearMethod

    weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": True}
    group = {"targets": ["Linear"], "weights": {**weights, "dynamic": False}}
    config = {"format": "pack-quantized", "config_groups": {"group_0": group}}
    int4 = CompressedTensorsConfig(config).linear_method()
    field = "quantization_config.config_groups.group_0.weights.group_size 64 does not divide the 96 input"
    with pytest.raises(
        ValueError, match=field + r" columns of each of the 2 ranks \(--tensor-parallel-size\)"
    ):
        RowParallelLinear(192, 8, tp_size=2, quant_method=int4)
    block = r"weight_block_size \[128, 128\] \(blocks of 128 columns\) does not divide the 64 input columns"
    with pytest.raises(ValueError, match=block):
        RowParallelLinear(128, 8, tp_size=2, quant_method=Fp8BlockLinearMethod(128, 128))


class ScaledLinearMethod(LinearMethodBase):
    """A stand-in for a quantized method: its own parameter layout and its own apply."""

    def create_weights(
        self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype,
        weight_loader,
    ) -> None:  # fmt: skip
        self.seen = (input_size_per_partition, output_partition_sizes, input_size, output_size)
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition))
        weight.output_dim, weight.input_dim, weight.weight_loader = 0, 1, weight_loader
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", nn.Parameter(torch.full((), 2.0)))

    def apply(self, layer, x, bias=None) -> torch.Tensor:
        return F.linear(x, layer.weight * layer.weight_scale, bias)


def test_a_quant_method_creates_and_applies_the_weights() -> None:
    assert isinstance(RowParallelLinear(36, 23).quant_method, UnquantizedLinearMethod)
    method = ScaledLinearMethod()
    layer = MergedColumnParallelLinear(37, [20, 44], bias=False, tp_size=2, tp_rank=1, quant_method=method)
    assert method.seen == (37, [10, 22], 37, 64)
    gate, up, x = randn(20, 37, seed=1), randn(44, 37, seed=2), randn(NUM_TOKENS, 37, seed=3)
    load(layer, "weight", gate, 0)
    load(layer, "weight", up, 1)
    expected = F.linear(x, 2.0 * torch.cat([gate[10:], up[22:]]))
    torch.testing.assert_close(layer(x), expected)
