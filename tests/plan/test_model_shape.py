"""Parameter counts of model shapes against hand arithmetic, against transformers' own models, and against
the tensors of the embedded GGUF."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tokenmill.plan.catalogue import MODELS, default_gguf_path
from tokenmill.plan.model_shape import ModelShape, from_hf_config, load_gguf, load_hf_dir


def test_llama_3_1_8b_counts_by_hand():
    counts = MODELS["llama-3.1-8b"].param_counts()
    assert counts.embedding == counts.lm_head == 128256 * 4096 == 525_336_576
    # q, o 4096x4096; k, v 4096x1024, per layer
    assert counts.attention == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024) == 1_342_177_280
    assert counts.dense_mlp == 32 * 3 * 4096 * 14336 == 5_637_144_576
    assert counts.norms_and_biases == 2 * 4096 * 32 + 4096 == 266_240
    assert counts.total == 8_030_261_248


def test_tied_model_has_no_lm_head():
    counts = MODELS["qwen3-0.6b"].param_counts()
    assert counts.lm_head == 0
    assert counts.embedding == 151936 * 1024
    # q/k norms (128 each) per layer are counted: the published total is 596,049,920
    assert counts.total == 596_049_920


@pytest.mark.parametrize(
    ("name", "total", "active_excluding_embedding"),
    [
        ("llama-3.1-70b", 70_553_706_496, None),
        ("qwen3-8b", 8_190_735_360, None),
        # Qwen publishes 30.5B total, 3.3B active (including the 0.31B embedding)
        ("qwen3-30b-a3b", 30_532_122_624, 3_041_867_776),
        # Mistral publishes 46.7B total, 12.9B active
        ("mixtral-8x7b", 46_702_792_704, 12_748_853_248),
        # DeepSeek publishes 671B total, 36.6B active including the 0.9B output head (MTP layer excluded)
        ("deepseek-v3", 671_026_419_200, 36_625_618_432),
    ],
)
def test_catalogue_totals_match_published_sizes(name, total, active_excluding_embedding):
    shape = MODELS[name]
    counts = shape.param_counts()
    assert counts.total == total
    if active_excluding_embedding is not None:
        active = (
            counts.total
            - counts.embedding
            - counts.routed_experts
            + counts.per_expert * shape.num_experts_per_tok * shape.num_moe_layers
        )
        assert active == active_excluding_embedding


TINY_CONFIGS = {
    "LlamaConfig": dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=48, intermediate_size=200
    ),
    "Qwen2Config": dict(  # qkv bias, tied embeddings, MHA
        hidden_size=80,
        num_attention_heads=5,
        num_key_value_heads=5,
        intermediate_size=150,
        tie_word_embeddings=True,
    ),
    "Qwen3Config": dict(  # q/k norms, head_dim not hidden/heads
        hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=40, intermediate_size=136
    ),
    "MixtralConfig": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=88,
        num_local_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=40,  # stray: Mixtral's classes do not read it
    ),
    "Qwen3MoeConfig": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=88,
        moe_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
    ),
    "Qwen2MoeConfig": dict(  # shared expert with its gate; one listed dense layer, every 2nd layer sparse
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=88,
        moe_intermediate_size=40,
        shared_expert_intermediate_size=56,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        decoder_sparse_step=2,
        num_hidden_layers=4,
    ),
    "DeepseekV3Config": dict(  # MLA with q LoRA, one dense first layer, a shared expert, router bias
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=96,
        moe_intermediate_size=24,
        n_routed_experts=6,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_group=1,
        topk_group=1,
        num_hidden_layers=3,
    ),
}


@pytest.mark.parametrize("config_class", list(TINY_CONFIGS))
def test_counts_match_transformers_models(config_class):
    spec = {"vocab_size": 1003, "num_hidden_layers": 2, **TINY_CONFIGS[config_class]}
    config = getattr(transformers, config_class)(**spec)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = transformers.AutoModelForCausalLM.from_config(config)
    stored = sum(p.numel() for p in model.parameters())
    # DeepSeek-V3's router correction bias is a buffer in transformers but a tensor in the checkpoint.
    stored += sum(b.numel() for name, b in model.named_buffers() if "e_score_correction_bias" in name)
    assert from_hf_config(config.to_dict(), config_class).param_counts().total == stored


def test_deepseek_hub_config_matches_catalogue():
    hub_config = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "topk_method": "noaux_tc",
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "max_position_embeddings": 163840,
    }
    assert from_hf_config(hub_config, "deepseek-v3") == MODELS["deepseek-v3"]


def test_hf_dir_reads_config_json(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }
    model_dir = tmp_path / "llama-3.1-8b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_hf_dir(model_dir) == MODELS["llama-3.1-8b"]


def test_hf_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="config.json has no 'hidden_size'"):
        from_hf_config({"model_type": "llama", "num_attention_heads": 4}, "broken")
    with pytest.raises(ValueError, match="malformed value"):
        from_hf_config(
            {
                "model_type": "llama",
                "hidden_size": "wide",
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 10,
            },
            "broken",
        )
    with pytest.raises(ValueError, match="config.json has no 'model_type'"):
        from_hf_config({"hidden_size": 64, "num_attention_heads": 4}, "broken")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_dir(tmp_path)


@pytest.mark.parametrize(
    ("model_type", "published"),
    [("gemma2", "Gemma-2-9B: tied table, four norms a layer"), ("gpt_oss", "GPT-OSS: sinks, expert biases")],
)
def test_layouts_the_planner_cannot_count_are_refused(model_type, published):
    # Read as a Llama, Gemma-2-9B's published config.json gave 10.16B parameters, not its 9.24B.
    config = {
        "model_type": model_type,
        "hidden_size": 3584,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "intermediate_size": 14336,
        "vocab_size": 256000,
    }
    with pytest.raises(ValueError, match=f"model_type '{model_type}' is not one the planner can count"):
        from_hf_config(config, published)


def test_non_positive_shape_is_rejected():
    with pytest.raises(ValueError, match="num_layers must be positive, got 0"):
        ModelShape("x", 64, 0, 4, 4, 16, 128, 100)


def test_default_gguf_shape_matches_its_tensors():
    from gguf import GGUFReader

    path = default_gguf_path()
    shape = load_gguf(path)
    assert (shape.hidden_size, shape.num_layers, shape.num_attention_heads, shape.num_kv_heads) == (
        576,
        30,
        9,
        3,
    )
    assert (shape.head_dim, shape.intermediate_size, shape.vocab_size) == (64, 1536, 49152)
    assert shape.tie_word_embeddings  # the GGUF has no output.weight
    assert not shape.is_moe and not shape.qk_norm and not shape.qkv_bias
    tensors_total = sum(int(t.n_elements) for t in GGUFReader(path).tensors)
    assert shape.param_counts().total == tensors_total == 134_515_008
    assert shape.param_counts() == MODELS["smollm2-135m"].param_counts()


def test_unreadable_gguf_is_a_clear_error(tmp_path):
    garbage = tmp_path / "broken.gguf"
    garbage.write_bytes(b"GGUF but not really" * 10)
    with pytest.raises(ValueError, match="cannot read GGUF file .*broken.gguf"):
        load_gguf(garbage)
