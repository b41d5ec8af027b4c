"""The pooling runner against transformers: last-token and mean pooling of the final hidden states,
L2-normalised, for bare-model checkpoints (Qwen3Model, LlamaModel), through chunked prefill, batching and
preemption; and the errors that keep generating and pooling engines apart."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import make_hf_model
from tokenmill.entrypoints.llm import LLM

PROMPTS = [list(range(5, 5 + n)) for n in (1, 7, 33, 60)]


@pytest.fixture(scope="module")
def bare_models(tmp_path_factory):
    """arch -> (directory of a bare-model checkpoint, the transformers bare model)."""
    models = {}
    for arch in ("qwen3", "llama"):
        base = make_hf_model(arch).model  # Qwen3Model / LlamaModel: saved without "model." prefixes
        path = tmp_path_factory.mktemp(f"{arch}_bare")
        base.save_pretrained(path)
        models[arch] = (str(path), base)
    return models


def reference(base, prompt: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = base(torch.tensor([prompt])).last_hidden_state[0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=-1)


def embeddings(llm: LLM, prompts=PROMPTS) -> list[torch.Tensor]:
    outputs = llm.embed(prompt_token_ids=prompts, use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outputs]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_matches_transformers_through_chunks_and_batches(bare_models, arch, pooling):
    path, base = bare_models[arch]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"][0].endswith("Model")
    # 16-token steps: the longer prompts are pooled over several chunks, next to other requests.
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        dtype="float32",
        pooling_type=pooling,
        max_num_batched_tokens=16,
        num_kv_blocks=64,
    )
    assert llm.engine.pooling_type == pooling
    for prompt, got in zip(PROMPTS, embeddings(llm), strict=True):
        want = reference(base, prompt, pooling)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-5), (len(prompt), (got - want).abs().max())
        assert abs(got.norm().item() - 1) < 1e-5


def test_mean_pooling_survives_preemption(bare_models):
    path, base = bare_models["qwen3"]
    prompts = [list(range(100 + i, 160 + i)) for i in range(4)]  # 60 tokens: 4 blocks each
    # 5 blocks for four 4-block prompts fed 16 tokens a step: requests are preempted mid-prompt.
    llm = LLM(
        path,
        skip_tokenizer_init=True,
        dtype="float32",
        pooling_type="mean",
        max_num_batched_tokens=16,
        num_kv_blocks=5,
        max_model_len=64,
    )
    got = embeddings(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, vector in zip(prompts, got):
        assert torch.allclose(vector, reference(base, prompt, "mean"), atol=1e-5)


def test_sentence_transformers_config_sets_the_default_pooling(bare_models, tmp_path):
    path, base = bare_models["llama"]
    for name in os.listdir(path):
        os.symlink(os.path.join(path, name), tmp_path / name)
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 96, "pooling_mode_mean_tokens": True})
    )
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32")
    assert llm.engine.pooling_type == "mean"
    (got,) = embeddings(llm, PROMPTS[2:3])
    assert torch.allclose(got, reference(base, PROMPTS[2], "mean"), atol=1e-5)


def test_a_causal_lm_checkpoint_pools_with_runner_pooling(hf_model_dirs):
    path, model = hf_model_dirs["qwen2"]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", runner="pooling")
    assert llm.engine.pooling_type == "last"
    (got,) = embeddings(llm, PROMPTS[1:2])
    assert torch.allclose(got, reference(model.model, PROMPTS[1], "last"), atol=1e-5)
    with pytest.raises(ValueError, match="LLM.embed"):
        llm.generate(prompt_token_ids=PROMPTS[1:2])


def test_runner_and_pooling_errors_name_the_knob(bare_models, hf_model_dirs):
    bare_path, _ = bare_models["qwen3"]
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(bare_path, skip_tokenizer_init=True, runner="generate")
    with pytest.raises(ValueError, match="pooling_type"):
        LLM(bare_path, skip_tokenizer_init=True, pooling_type="cls")
    with pytest.raises(ValueError, match="runner"):
        LLM(bare_path, skip_tokenizer_init=True, runner="embed")
    causal_path, _ = hf_model_dirs["qwen3"]
    with pytest.raises(ValueError, match="pooling_type needs runner"):
        LLM(causal_path, skip_tokenizer_init=True, pooling_type="mean")
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(causal_path, skip_tokenizer_init=True).embed(prompt_token_ids=PROMPTS[:1])


def test_embed_as_vllm_scripts_call_it(bare_models):
    """vLLM's shape (output.outputs.embedding) and keywords: truncate_prompt_tokens embeds the last k
    tokens; a PoolingParams or a LoRA adapter is refused by name."""
    path, base = bare_models["qwen3"]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", pooling_type="last", num_kv_blocks=32)
    (output,) = llm.embed(prompt_token_ids=PROMPTS[2], truncate_prompt_tokens=5, use_tqdm=False)
    assert output.prompt_token_ids == PROMPTS[2][-5:] and output.finished
    assert output.outputs.hidden_size == len(output.outputs.embedding)
    want = reference(base, PROMPTS[2][-5:], "last")
    assert torch.allclose(torch.tensor(output.outputs.embedding), want, atol=1e-5)
    with pytest.raises(ValueError, match="pooling_params"):
        llm.embed(prompt_token_ids=PROMPTS[:1], pooling_params=object())
    with pytest.raises(ValueError, match="lora_request"):
        llm.embed(prompt_token_ids=PROMPTS[:1], lora_request=object())


def test_encode_gives_vllms_pooling_outputs(bare_models):
    path, base = bare_models["llama"]
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", pooling_type="mean", num_kv_blocks=32)
    (output,) = llm.encode(prompt_token_ids=PROMPTS[1], pooling_task="embed", use_tqdm=False)
    assert isinstance(output.outputs.data, torch.Tensor) and output.prompt_token_ids == PROMPTS[1]
    assert torch.allclose(output.outputs.data, reference(base, PROMPTS[1], "mean"), atol=1e-5)
    with pytest.raises(ValueError, match="pooling_task"):
        llm.encode(prompt_token_ids=PROMPTS[1], pooling_task="classify")
