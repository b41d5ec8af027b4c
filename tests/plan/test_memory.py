"""Weight bytes, KV bytes per token, KV capacity and the smallest TP degree, against hand arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.plan.catalogue import MODELS
from tokenmill.plan.gpus import GPUS
from tokenmill.plan.memory import (
    Deployment,
    activation_reserve_bytes,
    kv_bytes_per_token,
    plan_at_tp,
    plan_memory,
    smallest_fitting_plan,
    valid_tp_degrees,
    weight_bytes,
)

LLAMA_8B = MODELS["llama-3.1-8b"]
H200 = GPUS["H200"]
# Llama-3.1-8B: linear weights inside the blocks (attention 1,342,177,280 + MLP 5,637,144,576) and the
# 16-bit rest (embedding and lm_head 2 x 525,336,576, norms 266,240).
LINEAR = 6_979_321_856
HALF_REST = 2 * (2 * 525_336_576 + 266_240)


def test_llama_8b_bf16_weights_are_16_06_gb():
    assert weight_bytes(LLAMA_8B, "bf16").total == 2 * 8_030_261_248 == 16_060_522_496


def test_fp8_and_int8_weights_take_one_byte_per_linear_weight():
    expected = LINEAR + HALF_REST
    assert weight_bytes(LLAMA_8B, "fp8").total == expected == 9_081_200_640
    assert weight_bytes(LLAMA_8B, "int8").total == expected


def test_int4_weights_take_half_a_byte_plus_a_bf16_scale_per_128():
    attention, mlp = 1_342_177_280, 5_637_144_576
    expected = attention // 2 + 2 * attention // 128 + mlp // 2 + 2 * mlp // 128 + HALF_REST
    assert weight_bytes(LLAMA_8B, "int4").total == expected == 5_700_591_616


def test_tied_embeddings_are_stored_once_and_read_whole():
    tied = MODELS["qwen3-0.6b"]
    untied = dataclasses.replace(tied, tie_word_embeddings=False)
    table_bytes = 2 * 151936 * 1024
    assert weight_bytes(tied, "bf16").total == 2 * 596_049_920
    assert weight_bytes(untied, "bf16").total == 2 * 596_049_920 + table_bytes
    # Tied: the table is the lm_head, streamed every step. Untied: the input table is only gathered.
    assert weight_bytes(tied, "bf16").input_embedding == 0
    assert weight_bytes(untied, "bf16").input_embedding == table_bytes
    assert weight_bytes(tied, "bf16").read_every_step == weight_bytes(untied, "bf16").read_every_step


def test_moe_weights_count_every_expert():
    mixtral = weight_bytes(MODELS["mixtral-8x7b"], "bf16")
    assert mixtral.total == 2 * 46_702_792_704
    assert mixtral.per_expert_layer == 2 * 3 * 4096 * 14336
    assert mixtral.routed_experts == mixtral.per_expert_layer * 8 * 32
    qwen_moe = weight_bytes(MODELS["qwen3-30b-a3b"], "fp8")
    # attention 905,969,664 + experts 28,991,029,248 at one byte; embedding, lm_head, routers and norms at two
    assert qwen_moe.total == 905_969_664 + 28_991_029_248 + 2 * (2 * 311_164_928 + 12_582_912 + 210_944)


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(LLAMA_8B, "bf16") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert kv_bytes_per_token(LLAMA_8B, "fp8") == 65_536
    # GQA: 8 KV heads for 64 query heads; MHA would be 8x larger
    llama_70b = MODELS["llama-3.1-70b"]
    assert kv_bytes_per_token(llama_70b, "bf16") == 2 * 80 * 8 * 128 * 2 == 327_680
    mha = dataclasses.replace(llama_70b, num_kv_heads=64)
    assert kv_bytes_per_token(mha, "bf16") == 8 * 327_680
    assert kv_bytes_per_token(MODELS["qwen3-30b-a3b"], "bf16") == 2 * 48 * 4 * 128 * 2 == 98_304


def test_kv_heads_split_over_tp_and_replicate_past_their_count():
    llama_70b = MODELS["llama-3.1-70b"]
    assert kv_bytes_per_token(llama_70b, "bf16", tp=2) == 163_840
    assert kv_bytes_per_token(llama_70b, "bf16", tp=8) == 40_960
    assert kv_bytes_per_token(llama_70b, "bf16", tp=16) == 40_960  # one replicated head per rank


def test_mla_caches_the_compressed_latent_on_every_rank():
    deepseek = MODELS["deepseek-v3"]
    assert kv_bytes_per_token(deepseek, "bf16") == 61 * (512 + 64) * 2 == 70_272
    assert kv_bytes_per_token(deepseek, "fp8") == 35_136
    assert kv_bytes_per_token(deepseek, "bf16", tp=8) == 70_272


def test_llama_8b_capacity_on_one_h200():
    plan = plan_memory(Deployment(LLAMA_8B, H200, context_len=8192), tp=1)
    usable = 143771 * 2**20 * 9 // 10  # driver total x 0.9
    # 1 GiB fixed + 8192 tokens x (4 x 4096 + QKV 6144 + 3 x 14336) x 2 bytes + 256 x vocab x fp32 logits
    reserve = 2**30 + 8192 * (4 * 4096 + 6144 + 3 * 14336) * 2 + 256 * 128256 * 4
    assert (
        (plan.usable_bytes_per_gpu, plan.reserve_bytes_per_gpu)
        == (usable, reserve)
        == (135_679_338_086, 2_278_817_792)
    )
    kv_cache = usable - 16_060_522_496 - reserve
    assert plan.kv_cache_bytes_per_gpu == kv_cache == 117_339_997_798
    assert plan.num_kv_blocks == kv_cache // (16 * 131_072) == 55_952
    assert plan.kv_capacity_tokens == 55_952 * 16 == 895_232
    assert plan.max_concurrent_seqs == 55_952 // (8192 // 16) == 109


def test_capacity_rounds_each_sequence_up_to_whole_blocks():
    plan = plan_memory(Deployment(LLAMA_8B, H200, context_len=8193), tp=1)
    assert plan.max_concurrent_seqs == 55_952 // 513


def test_reserve_shrinks_with_tp_and_batched_tokens():
    assert activation_reserve_bytes(LLAMA_8B, 2, 8192) < activation_reserve_bytes(LLAMA_8B, 1, 8192)
    assert activation_reserve_bytes(LLAMA_8B, 1, 2048) < activation_reserve_bytes(LLAMA_8B, 1, 8192)


def test_smallest_tp_that_fits():
    llama_70b = MODELS["llama-3.1-70b"]
    assert smallest_fitting_plan(Deployment(llama_70b, H200), num_gpus=8).tp == 2
    assert smallest_fitting_plan(Deployment(llama_70b, H200, weight_dtype="fp8"), num_gpus=8).tp == 1
    plan = smallest_fitting_plan(Deployment(llama_70b, H200), num_gpus=8)
    assert (plan.weight_bytes_per_gpu, plan.kv_capacity_tokens, plan.max_concurrent_seqs) == (
        70_553_706_496,
        382_048,
        46,
    )


def test_too_few_gpus_names_the_tp_that_would_fit():
    with pytest.raises(ValueError, match=r"does not fit at tp 1 on H200.*it fits at tp 2: pass --num-gpus 2"):
        smallest_fitting_plan(Deployment(MODELS["llama-3.1-70b"], H200), num_gpus=1)
    with pytest.raises(ValueError, match="it fits at tp 16: pass --num-gpus 16"):
        smallest_fitting_plan(Deployment(MODELS["deepseek-v3"], H200), num_gpus=8)


def test_model_that_fits_no_number_of_gpus():
    with pytest.raises(ValueError, match="nor at any tensor-parallel degree up to 64"):
        smallest_fitting_plan(Deployment(MODELS["deepseek-v3"], GPUS["RTX 4090"]), num_gpus=8)


def test_tp_must_split_heads_and_mlp_evenly():
    smollm = MODELS["smollm2-135m"]  # 9 query heads, 3 KV heads; 9 ranks cannot split its 1,536-wide MLP
    assert valid_tp_degrees(smollm, 9) == [1, 3]
    with pytest.raises(ValueError, match="--tp 2 does not divide smollm2-135m's 9 attention heads"):
        plan_at_tp(Deployment(smollm, H200), 2)
    # Qwen2.5-1.5B: 12 heads and 2 KV heads split 6 ways, but the engine cannot split its 8,960-wide MLP so
    qwen = dataclasses.replace(LLAMA_8B, num_attention_heads=12, num_kv_heads=2, intermediate_size=8960)
    assert valid_tp_degrees(qwen, 12) == [1, 2, 4]
    with pytest.raises(ValueError, match="--tp 6 does not divide llama-3.1-8b's intermediate_size 8960"):
        plan_at_tp(Deployment(qwen, H200), 6)


@pytest.mark.parametrize(
    ("knob", "value", "message"),
    [
        ("context_len", 0, "--context must be positive, got 0"),
        ("context_len", -5, "--context must be positive, got -5"),
        ("max_num_batched_tokens", 0, "--max-num-batched-tokens must be positive"),
        ("gpu_memory_utilization", 1.5, r"--gpu-memory-utilization must be in \(0, 1\]"),
        ("weight_dtype", "fp4", "unknown --weight-dtype 'fp4'"),
        ("kv_dtype", "int8", "unknown --kv-dtype 'int8'"),
    ],
)
def test_deployment_validates_its_knobs(knob, value, message):
    with pytest.raises(ValueError, match=message):
        Deployment(LLAMA_8B, H200, **{knob: value})


def _tiny(model_type: str, architecture: str, **keys) -> dict:
    return {
        "architectures": [architecture], "model_type": model_type, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 1024, "torch_dtype": "bfloat16", **keys,
    }  # fmt: skip


@pytest.mark.parametrize(
    "config",
    [
        _tiny("mistral", "MistralForCausalLM", sliding_window=128),  # Mistral-7B-v0.1: every layer slides
        _tiny("mistral", "MistralForCausalLM", max_position_embeddings=8192),  # no key: transformers' 4096
        _tiny("mistral", "MistralForCausalLM", sliding_window=None, head_dim=24),  # Mistral-Small: head_dim
        _tiny("mixtral", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
              sliding_window=None),
        # Qwen2.5: qkv bias, tied, a window that slides nowhere without use_sliding_window
        _tiny("qwen2", "Qwen2ForCausalLM", tie_word_embeddings=True, sliding_window=128,
              use_sliding_window=False),
        _tiny("qwen2", "Qwen2ForCausalLM", sliding_window=128, use_sliding_window=True, max_window_layers=1),
        _tiny("qwen3", "Qwen3ForCausalLM", head_dim=40, sliding_window=None, max_window_layers=2),
        _tiny("qwen3_moe", "Qwen3MoeForCausalLM", head_dim=24, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=40, sliding_window=128, use_sliding_window=False),
    ],
)  # fmt: skip
def test_the_planner_and_the_engine_agree_on_parameters_kv_bytes_and_context(config, tmp_path):
    import json

    from tokenmill import LLM
    from tokenmill.plan.model_shape import from_hf_config

    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=256
    )
    shape = from_hf_config(config, "tiny")
    runner = llm.engine.runner
    assert sum(p.numel() for p in runner.model.parameters()) == shape.param_counts().total
    assert runner.kv_bytes_per_block() == kv_bytes_per_token(shape, "bf16") * runner.block_size
    # The engine caps the context at a sliding window (its attention is full-context), never the KV per token.
    assert llm.engine.max_model_len == shape.context_limit
