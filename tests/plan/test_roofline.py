"""Decode and prefill rooflines against hand arithmetic for known shapes."""

from __future__ import annotations

import pytest

from tokenmill.plan.catalogue import MODELS
from tokenmill.plan.gpus import GPUS, ceilings_for
from tokenmill.plan.memory import Deployment
from tokenmill.plan.roofline import (
    attention_flops_per_context_token,
    compute_bound_batch,
    decode_point,
    expected_experts_touched,
    largest_batch_within,
    matmul_flops_per_token,
    prefill_point,
)

H200 = GPUS["H200"]
LLAMA_8B = MODELS["llama-3.1-8b"]
DATASHEET = ceilings_for(H200, "bf16", measured=False)
# Llama-3.1-8B bf16: 16,060,522,496 weight bytes less the 1,050,673,152-byte input table, which a decode
# step only gathers one 8,192-byte row of per sequence.
STREAMED = 16_060_522_496 - 1_050_673_152


def test_llama_8b_batch_1_decode_ceiling_is_about_300_tok_s():
    point = decode_point(Deployment(LLAMA_8B, H200), DATASHEET, tp=1, batch=1, context_len=8192)
    bytes_moved = STREAMED + 8192 + 8192 * 131_072
    assert point.bytes_moved == bytes_moved == 16_083_599_360
    assert point.bound == "bandwidth"
    assert point.floor_s == pytest.approx(bytes_moved / 4.8e12)
    assert point.tok_s_per_seq == pytest.approx(298.44, abs=0.01)
    # With all 16.06 GB counted the figure would be 4.8e12 / 16.06e9 = 298.9; at a short context, where
    # almost no KV is read, the gathered table is what separates the two:
    short = decode_point(Deployment(LLAMA_8B, H200), DATASHEET, tp=1, batch=1, context_len=1)
    assert short.tok_s_per_seq == pytest.approx(4.8e12 / (STREAMED + 8192 + 131_072))
    assert short.tok_s_per_seq == pytest.approx(319.79, abs=0.01)


def test_llama_8b_decode_flops():
    # 2 x (attention 1,342,177,280 + MLP 5,637,144,576 + lm_head 525,336,576) per token
    assert matmul_flops_per_token(LLAMA_8B) == 2 * 7_504_658_432
    # QK^T and PV: 4 x 32 heads x 128 per layer per cached token, 32 layers
    assert attention_flops_per_context_token(LLAMA_8B, "decode") == 32 * 4 * 32 * 128 == 524_288
    point = decode_point(Deployment(LLAMA_8B, H200), DATASHEET, tp=1, batch=4, context_len=1000)
    assert point.flops == 4 * (2 * 7_504_658_432 + 524_288 * 1000)
    assert point.tok_s_aggregate == pytest.approx(4 * point.tok_s_per_seq)
    assert point.arithmetic_intensity == pytest.approx(point.flops / point.bytes_moved)


def test_decode_turns_compute_bound_at_the_ridge():
    deployment = Deployment(LLAMA_8B, H200)
    # With no KV: B x 15,009,316,864 / 989e12 >= (STREAMED + 8192 B) / 4.8e12 first holds at B = 207
    assert compute_bound_batch(deployment, DATASHEET, tp=1, context_len=0) == 207
    before = decode_point(deployment, DATASHEET, tp=1, batch=206, context_len=0)
    after = decode_point(deployment, DATASHEET, tp=1, batch=207, context_len=0)
    assert (before.bound, after.bound) == ("bandwidth", "compute")
    # Every cached token adds 131,072 bytes but only 524,288 FLOPs (4 FLOP/B, far under the 206 ridge):
    # past a few hundred tokens of context, no batch is compute-bound.
    assert compute_bound_batch(deployment, DATASHEET, tp=1, context_len=8192) is None
    assert compute_bound_batch(deployment, DATASHEET, tp=1, context_len=300) == 438


def test_largest_batch_within_a_step_time():
    deployment = Deployment(LLAMA_8B, H200)
    # Bandwidth-bound at 8,192 cached tokens: B sequences move STREAMED + B x (8,192 + 8,192 x 131,072)
    # bytes, which 20 ms at 4.8 TB/s (96e9 bytes) allows for B <= 75.4.
    assert largest_batch_within(deployment, DATASHEET, tp=1, context_len=8192, step_time_s=0.020) == 75
    within = decode_point(deployment, DATASHEET, tp=1, batch=75, context_len=8192)
    over = decode_point(deployment, DATASHEET, tp=1, batch=76, context_len=8192)
    assert within.floor_s <= 0.020 < over.floor_s
    # Batch 1 already takes 3.35 ms
    assert largest_batch_within(deployment, DATASHEET, tp=1, context_len=8192, step_time_s=0.003) == 0


def test_prefill_floor_for_1024_tokens():
    point = prefill_point(Deployment(LLAMA_8B, H200), DATASHEET, tp=1, input_len=1024)
    # linear layers for every token, lm_head for the last only, causal attention over 1024 x 1025 / 2 pairs
    flops = 2 * 6_979_321_856 * 1024 + 2 * 525_336_576 + 524_288 * 1024 * 1025 // 2
    assert point.flops == flops == 14_569_848_176_640
    assert point.bytes_moved == STREAMED + 1024 * 8192 + 1024 * 131_072
    assert point.bound == "compute"
    assert point.floor_s == pytest.approx(flops / 989e12)  # 14.73 ms


def test_fp8_weights_halve_the_bytes_and_use_fp8_tensor_cores():
    deployment = Deployment(LLAMA_8B, H200, weight_dtype="fp8")
    ceilings = ceilings_for(H200, "fp8", measured=False)
    point = decode_point(deployment, ceilings, tp=1, batch=1, context_len=0)
    assert point.bytes_moved == 9_081_200_640 - 1_050_673_152 + 8192
    assert ceilings.flops == 1979e12
    assert prefill_point(deployment, ceilings, tp=1, input_len=1024).floor_s == pytest.approx(
        14_569_848_176_640 / 1979e12
    )


def test_int4_weights_quarter_the_linear_bytes_but_compute_in_bf16():
    deployment = Deployment(LLAMA_8B, H200, weight_dtype="int4")
    ceilings = ceilings_for(H200, "int4", measured=False)
    point = decode_point(deployment, ceilings, tp=1, batch=1, context_len=0)
    assert point.bytes_moved == 5_700_591_616 - 1_050_673_152 + 8192
    assert ceilings.flops == 989e12
    # a quarter of the bytes per FLOP: the ridge arrives at a quarter of the batch, near 207 / 4
    assert compute_bound_batch(deployment, ceilings, tp=1, context_len=0) == 64


def test_moe_decode_reads_only_the_routed_experts():
    mixtral = MODELS["mixtral-8x7b"]
    assert expected_experts_touched(mixtral, 1) == pytest.approx(2.0)
    assert expected_experts_touched(mixtral, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert expected_experts_touched(mixtral, 1000) == pytest.approx(8.0)
    point = decode_point(Deployment(mixtral, H200), DATASHEET, tp=1, batch=1, context_len=0)
    # everything but the experts and the input table (2,949,128,192) + 2 experts x 352,321,536 x 32 layers
    assert point.bytes_moved == 2_949_128_192 + 2 * 352_321_536 * 32 + 8192
    qwen_moe = MODELS["qwen3-30b-a3b"]
    assert expected_experts_touched(qwen_moe, 1) == pytest.approx(8.0)
    assert 127 < expected_experts_touched(qwen_moe, 256) < 128


def test_mla_attention_flops():
    deepseek = MODELS["deepseek-v3"]
    # decode works in the latent: scores over 512 + 64, values over 512, for 128 heads in 61 layers
    assert attention_flops_per_context_token(deepseek, "decode") == 61 * (2 * 128 * 576 + 2 * 128 * 512)
    # prefill expands per-head keys (128 + 64) and values (128)
    assert attention_flops_per_context_token(deepseek, "prefill") == 61 * (2 * 128 * 192 + 2 * 128 * 128)


def test_tp_divides_weights_and_flops_per_gpu():
    llama_70b = MODELS["llama-3.1-70b"]
    one = decode_point(
        Deployment(llama_70b, H200, weight_dtype="fp8"), DATASHEET, tp=1, batch=8, context_len=0
    )
    two = decode_point(
        Deployment(llama_70b, H200, weight_dtype="fp8"), DATASHEET, tp=2, batch=8, context_len=0
    )
    assert two.bytes_moved == pytest.approx(one.bytes_moved / 2)
    assert two.flops == pytest.approx(one.flops / 2)
