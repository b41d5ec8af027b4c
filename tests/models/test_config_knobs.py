"""Config knobs a checkpoint may carry beyond the shapes test_llama_equivalence.py runs: each runs as
transformers runs it (the same greedy tokens), or is refused at load by the field's name."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.conftest import make_hf_model
from tests.models.test_llama_equivalence import generate_ids, hf_greedy, make_llm, random_prompts

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=24, intermediate_size=96)
YARN = {
    "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
    "attention_factor": 0.8, "beta_fast": 16.0, "beta_slow": 2.0,
}  # fmt: skip
KNOBS = {
    # Inside max_position_embeddings (which bounds max_model_len) dynamic NTK is the default rope.
    "dynamic-rope": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "linear-rope": ("qwen2", dict(rope_scaling={"rope_type": "linear", "factor": 3.0}, rope_theta=12345.0)),
    "yarn-rope": ("qwen3", dict(rope_scaling=YARN)),  # the prompts run past its original 32 positions
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True, rope_scaling=None)),
    "stray-biases": ("mistral", dict(attention_bias=True, mlp_bias=True)),  # Mistral's classes read neither
    "moe-sparse-step": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=True)),
    # A stray moe_intermediate_size, which Mixtral's classes do not read: the experts are intermediate_size.
    "mixtral-top1": ("mixtral", dict(num_experts_per_tok=1, head_dim=16, moe_intermediate_size=40)),
}


@pytest.mark.parametrize("knob", KNOBS)
def test_the_knob_runs_as_transformers_runs_it(knob, tmp_path):
    arch, overrides = KNOBS[knob]
    hf_model = make_hf_model(arch, **{**TINY, **overrides})
    hf_model.save_pretrained(tmp_path)
    prompts = random_prompts([45, 6])
    got = generate_ids(make_llm(str(tmp_path)), prompts)
    assert got == [hf_greedy(hf_model, p) for p in prompts]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(rope_scaling={
                "rope_type": "longrope", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12,
                "original_max_position_embeddings": 128,
            }),
            "rope_scaling type 'longrope' is not supported",
        ),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0}, partial_rotary_factor=0.5),
            "partial_rotary_factor 0.5: rotary over 12 of head_dim 24",
        ),
    ],
)  # fmt: skip
def test_a_rope_it_cannot_run_is_refused_by_name(overrides, message, tmp_path):
    make_hf_model("llama", **{**TINY, **overrides}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        make_llm(str(tmp_path))


@pytest.mark.parametrize("stored_head", ["embedding", "its-own"])
def test_a_tied_checkpoint_that_stores_a_head_runs_as_transformers_runs_it(stored_head, tmp_path):
    """transformers v5 unties a tied pair whose checkpoint stores an lm_head.weight unlike the embedding."""
    make_hf_model("qwen2", **TINY).save_pretrained(tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    embedding = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embedding.clone() if stored_head == "embedding" else embedding.flip(0)
    save_file(tensors, path, metadata={"format": "pt"})
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    llm = make_llm(str(tmp_path))
    model = llm.engine.runner.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (stored_head == "embedding")
    prompts = random_prompts([9, 4])
    assert generate_ids(llm, prompts) == [hf_greedy(hf_model.eval(), p) for p in prompts]
