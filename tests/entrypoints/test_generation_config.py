"""The model's generation_config.json as the defaults of requests that leave a sampling knob unset, as vLLM
takes it: --generation-config auto (the model's), vllm (none), DIR (that one); --override-generation-config
on top; a request's own values win (max_tokens: the smaller, as vLLM caps it)."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.entrypoints.generation_config import default_sampling_params
from tokenmill.entrypoints.openai.common import resolve_max_tokens
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

# As Qwen3's ships it, with keys that are not sampling defaults (eos, do_sample).
QWEN3_STYLE = {
    "bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_k": 20,
    "top_p": 0.95, "max_new_tokens": 7, "transformers_version": "4.51.0",
}  # fmt: skip


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_STYLE))
    return str(tmp_path)


def test_auto_reads_the_models_sampling_keys(model_dir):
    assert default_sampling_params(EngineConfig(model=model_dir)) == {
        "temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 7
    }  # fmt: skip


def test_vllm_ignores_the_file_and_overrides_go_on_top(model_dir, tmp_path_factory):
    assert default_sampling_params(EngineConfig(model=model_dir, generation_config="vllm")) == {}
    override = {"temperature": 0.2, "min_p": 0.1, "repetition_penalty": 1.1, "seed": 3}
    config = EngineConfig(model=model_dir, override_generation_config=override)
    assert default_sampling_params(config) == {
        "temperature": 0.2, "top_k": 20, "top_p": 0.95, "max_tokens": 7, "min_p": 0.1,
        "repetition_penalty": 1.1,
    }  # fmt: skip
    config = EngineConfig(model=model_dir, generation_config="vllm", override_generation_config=override)
    assert default_sampling_params(config) == {"temperature": 0.2, "min_p": 0.1, "repetition_penalty": 1.1}
    # A directory of its own: the default (GGUF) model has no generation config.
    assert default_sampling_params(EngineConfig()) == {}
    assert default_sampling_params(EngineConfig(generation_config=model_dir))["top_k"] == 20


def test_bad_generation_configs_fail_at_start(model_dir, tmp_path):
    with pytest.raises(ValueError, match="generation_config must be auto"):
        EngineConfig(generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="top_p"):
        default_sampling_params(EngineConfig(model=model_dir, override_generation_config={"top_p": 3}))
    with pytest.raises(ValueError, match="override_generation_config must be a dict"):
        EngineConfig(override_generation_config="temperature=0")


def test_a_requests_own_values_win_and_unset_ones_take_the_defaults():
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.2}
    messages = [{"role": "user", "content": "Hi"}]
    unset = ChatCompletionRequest(messages=messages).sampling_params(16, None, None, defaults)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p, unset.repetition_penalty) == (
        0.6, 20, 0.95, 0.05, 1.2
    )  # fmt: skip
    given = {"temperature": 0, "top_k": -1, "top_p": 1, "min_p": 0, "repetition_penalty": 1}
    own = ChatCompletionRequest(messages=messages, **given).sampling_params(16, None, None, defaults)
    assert (own.temperature, own.top_k, own.top_p, own.min_p, own.repetition_penalty) == (0, 0, 1, 0, 1)
    nulls = {name: None for name in given}  # null means unset, as in vLLM
    completion = CompletionRequest(prompt="a", **nulls).sampling_params(16, None, None, defaults)
    assert (completion.temperature, completion.top_k) == (0.6, 20)
    plain = CompletionRequest(prompt="a").sampling_params(16, None)  # no defaults: the neutral ones
    assert (plain.temperature, plain.top_k, plain.min_p, plain.repetition_penalty) == (1.0, 0, 0.0, 1.0)


def test_max_tokens_is_capped_by_the_generation_configs():
    assert resolve_max_tokens(10, None, 100, "prompt", default=7) == 7
    assert resolve_max_tokens(10, 50, 100, "prompt", default=7) == 7  # vLLM takes the smaller
    assert resolve_max_tokens(10, 5, 100, "prompt", default=7) == 5
    assert resolve_max_tokens(95, None, 100, "prompt", default=7) == 5
    assert resolve_max_tokens(10, None, 100, "prompt") == 90


def test_offline_llm_defaults(model_dir):
    llm = LLM("default", load_format="dummy", generation_config=model_dir, num_kv_blocks=16, max_model_len=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.max_tokens) == (0.6, 20, 0.95, 7)
    (output,) = llm.generate(prompt_token_ids=[[1, 2, 3]], use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 7  # random weights: no EOS this early
    (own,) = llm.generate(
        prompt_token_ids=[[1, 2, 3]],
        sampling_params=SamplingParams(max_tokens=9, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(own.outputs[0].token_ids) == 9
    plain = LLM("default", load_format="dummy", generation_config="vllm", num_kv_blocks=16, max_model_len=64)
    assert plain.get_default_sampling_params() == SamplingParams()
