"""The offline LLM API on the embedded SmolLM2 GGUF: equality with transformers' own GGUF loading,
text-level sampling features, and clear errors for bad input that leave the engine serving."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.loader import resolve_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a color."}],
]


@pytest.fixture(scope="module")
def llm():
    # fp32: the greedy tokens and texts below are transformers' fp32 ones; bf16 may pick a near tie.
    return LLM(model="default", max_model_len=1024, max_num_seqs=8, dtype="float32")


def test_smollm2_gguf_greedy_matches_transformers_gguf(
    llm, transformers_gguf_tokenizer, transformers_gguf_model
):
    hf_tokenizer, hf_model = transformers_gguf_tokenizer, transformers_gguf_model  # transformers' GGUF load
    outputs = llm.chat(CHATS, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
    for chat, output in zip(CHATS, outputs):
        ids = hf_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        input_ids = ids["input_ids"]
        assert output.prompt_token_ids == input_ids[0].tolist()
        with torch.no_grad():
            expected = hf_model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=24,
                min_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, input_ids.shape[1] :].tolist()
        assert output.outputs[0].token_ids == expected
        assert output.outputs[0].text == hf_tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_stops_at_eos_with_reason_stop(llm):
    out = llm.chat(CHATS[0], SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == "The capital of France is Paris."


def test_stop_string_cut_from_text(llm):
    out = llm.chat(CHATS[0], SamplingParams(max_tokens=64, temperature=0, stop=["Paris"]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text == "The capital of France is "
    assert completion.finish_reason == "stop" and completion.stop_reason == "Paris"
    kept = llm.chat(
        CHATS[0],
        SamplingParams(max_tokens=64, temperature=0, stop=["Paris"], include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept[0].outputs[0].text == "The capital of France is Paris"


def test_stop_strings_wait_for_min_tokens(llm):
    # "The" appears in the very first token; under min_tokens it must neither stop nor cut the text.
    params = SamplingParams(max_tokens=12, min_tokens=4, temperature=0, stop=["The"])
    completion = llm.chat(CHATS[0], params, use_tqdm=False)[0].outputs[0]
    assert completion.text.startswith("The capital of France is Paris.")
    assert len(completion.token_ids) >= 4


def test_max_tokens_length_and_min_tokens(llm):
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
    out = llm.chat(CHATS[0], SamplingParams(max_tokens=40, min_tokens=20, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 20


def test_n_samples_seeded_and_reproducible(llm):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=7)
    first = llm.generate("The weather today is", params, use_tqdm=False)[0]
    again = llm.generate("The weather today is", params, use_tqdm=False)[0]
    texts = [o.text for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert texts == [o.text for o in again.outputs]
    assert len(set(texts)) > 1


def test_seed_independent_of_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=123)
    alone = llm.generate("Tell me a joke", params, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["Hello there", "Tell me a joke", "Count to ten"],
        [SamplingParams(max_tokens=12, temperature=1.0), params, SamplingParams(max_tokens=7)],
        use_tqdm=False,
    )
    assert crowd[1].outputs[0].token_ids == alone


def test_logprobs(llm):
    out = llm.generate("The sky is", SamplingParams(max_tokens=4, temperature=0, logprobs=3), use_tqdm=False)[
        0
    ]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert token_id in entry and entry[token_id].rank == 1  # greedy: the sampled token is the top one
        assert 3 <= len(entry) <= 4
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in entry.values())
    assert completion.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs))
    )


def test_incremental_detokenization_never_breaks_utf8(llm):
    from tokenmill.serving.detokenizer import IncrementalDetokenizer

    tokenizer = llm.get_tokenizer()
    text = "héllo 🌍 日本語 ünïcödé 👩‍👩‍👧"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1, 2], SamplingParams())
    deltas = []
    for token_id in ids:
        detok.update([token_id])
        deltas.append(detok.take_delta(finished=False))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert len([d for d in deltas if d]) < len(ids)  # some multi-byte characters span tokens


@pytest.mark.parametrize(
    "params, knob",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(n=0), "n"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(min_tokens=9, max_tokens=3), "min_tokens"),
    ],
)
def test_bad_sampling_params_name_the_knob(params, knob):
    with pytest.raises(ValueError, match=knob):
        SamplingParams(**params)


def test_bad_prompts_fail_alone_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate(prompt_token_ids=[[]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len=1024"):
        llm.generate(prompt_token_ids=[[5] * 1025], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(prompt_token_ids=[[5, 10**9]], use_tqdm=False)
    # A batch with one bad prompt submits nothing at all.
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate(prompt_token_ids=[[5, 6], []], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="one key, 'prompt'"):
        llm.generate([{"text": "Hello"}], use_tqdm=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_asked_for_without_cuda_is_named():
    with pytest.raises(ValueError, match="device='cuda' but this machine has no CUDA"):
        LLM(model="default", device="cuda")


def test_vllm_prompt_dicts(llm):
    """vLLM's prompt forms: {"prompt": text} and {"prompt_token_ids": [...]}, alone or in a list."""
    params = SamplingParams(max_tokens=4, temperature=0)
    text = llm.generate("Hello there", params, use_tqdm=False)[0].outputs[0].token_ids
    ids = llm.get_tokenizer().encode("Hello there")
    dicts = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [text, text]
    assert llm.generate({"prompt": "Hello there"}, params, use_tqdm=False)[0].outputs[0].token_ids == text


def test_cache_salt_keeps_prefixes_apart(llm):
    """vLLM's {"prompt", "cache_salt"}: a prompt shares prefix-cache blocks only with prompts of the same
    salt (both unsalted included)."""
    params = SamplingParams(max_tokens=1, temperature=0)
    prefix = "Salted prefix, long enough to fill a few blocks of the cache. " * 4

    def cached(suffix: str, salt: str | None = None) -> int:
        prompt = {"prompt": prefix + suffix} | ({"cache_salt": salt} if salt else {})
        return llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens

    assert cached("One", "tenant-a") == 0
    assert cached("Two", "tenant-b") == 0
    assert cached("Three") == 0
    assert cached("Four", "tenant-a") >= 48 and cached("Five", "tenant-b") >= 48 and cached("Six") >= 48
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate({"prompt": "x", "cache_salt": ""}, params, use_tqdm=False)


def test_priority_needs_the_priority_policy(llm):
    """As vLLM's: a priority other than 0 is refused under the default fcfs policy, before anything is
    submitted."""
    params = SamplingParams(max_tokens=1, temperature=0)
    with pytest.raises(ValueError, match="priority scheduling is not enabled") as caught:
        llm.generate(["a", "b"], params, priority=[0, 1], use_tqdm=False)
    assert caught.value.param == "priority" and not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["a", "b"], params, priority=[0, 0], use_tqdm=False)) == 2


def test_stop_strings_need_a_tokenizer(tmp_path):
    from tests.conftest import make_hf_model

    make_hf_model("llama").save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        llm.generate(prompt_token_ids=[[5, 6]], sampling_params=SamplingParams(stop=["x"]), use_tqdm=False)


def test_bad_models_and_engine_knobs(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        LLM(model=str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ValueError, match="architecture"):
        LLM(model=str(tmp_path), load_format="dummy", skip_tokenizer_init=True)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 13)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(model=str(broken))
    with pytest.raises(ValueError, match="block_size"):
        LLM(model="default", block_size=0)
    for utilization in (1.5, "0.5", None):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            LLM(model="default", gpu_memory_utilization=utilization)
    with pytest.raises(ValueError, match="seed"):
        LLM(model="default", seed="x")
    with pytest.raises(ValueError, match="dtype"):
        LLM(model="default", dtype="float7")


def test_unreadable_safetensors(tmp_path):
    from tests.conftest import make_hf_model

    make_hf_model("qwen2").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True)


def test_max_model_len_that_cannot_fit(tmp_path):
    from tests.conftest import make_hf_model

    make_hf_model("qwen2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="max_model_len=512 needs 32 KV blocks but only 4 fit"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=4)
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, max_model_len=4096)


def test_the_embedded_tokenizer_by_name():
    """tokenizer='default' is the embedded model's, as `bench --tokenizer default` reads it (not a hub id)."""
    llm = LLM(model="default", tokenizer="default", load_format="dummy", max_model_len=64, num_kv_blocks=8)
    assert llm.get_tokenizer().encode("Hello") == resolve_model("default").load_tokenizer().encode("Hello")


def test_chat_constraints_follow_what_the_template_did_with_the_thinking(tmp_path):
    """LLM.chat under a reasoning parser (StructuredOutputsParams.reasoning): a template that opens
    `<think>` leaves the output's thinking free under qwen3 too (the random model never closes it: no
    "yes" in 6 tokens); one that closes it (enable_thinking false) constrains the first token under
    deepseek_r1 too ("yes" at once)."""
    from tests.entrypoints.openai.test_reasoning import THINKING_TEMPLATE, thinking_model
    from tokenmill.sampling_params import StructuredOutputsParams

    llm = LLM(thinking_model(tmp_path / "model"), dtype="float32", max_model_len=1024, num_kv_blocks=64)
    messages = [{"role": "user", "content": "Ok?"}]

    def answer(parser: str, **template_kwargs) -> tuple[str, str | None]:
        constraint = StructuredOutputsParams(choice=["yes"], reasoning=parser)
        params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=constraint)
        (output,) = llm.chat(
            messages, params, use_tqdm=False, chat_template=THINKING_TEMPLATE,
            chat_template_kwargs=template_kwargs,
        )  # fmt: skip
        assert params.structured_outputs.prompt_thinking is None  # the caller's params are left as given
        return output.outputs[0].text, output.outputs[0].finish_reason

    thought, finish_reason = answer("qwen3")
    assert finish_reason == "length" and "yes" not in thought
    assert answer("deepseek_r1", enable_thinking=False) == ("yes", "stop")


def test_reasoning_parser_holds_every_constraint_until_the_thinking_ends(tmp_path):
    """LLM(reasoning_parser=...), as vLLM's LLM takes it: constraints apply after the thinking without
    each request saying so (deepseek_r1: the output starts inside it; the random model never closes it,
    so no "yes" comes in 6 tokens, where without the parser "yes" comes at once). A tokenizer without
    the tags, or a parser not known, is refused by the knob's name."""
    from tests.entrypoints.openai.test_reasoning import thinking_model
    from tokenmill.sampling_params import StructuredOutputsParams

    path = thinking_model(tmp_path / "model")
    params = SamplingParams(
        temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(choice=["yes"])
    )
    llm = LLM(path, dtype="float32", max_model_len=1024, num_kv_blocks=64, reasoning_parser="deepseek_r1")
    (held,) = llm.generate(["Ok?"], params, use_tqdm=False)
    assert held.outputs[0].finish_reason == "length" and "yes" not in held.outputs[0].text
    assert params.structured_outputs.reasoning is None  # the caller's params are left as given
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(path, reasoning_parser="granite")
    with pytest.raises(
        ValueError, match="reasoning_parser deepseek_r1: the model's tokenizer has no <think>"
    ):
        LLM("default", load_format="dummy", max_model_len=64, num_kv_blocks=8, reasoning_parser="deepseek_r1")


def test_a_dropped_llm_gives_its_engine_back() -> None:
    """An LLM dropped frees its engine and model (the collector, frozen at start-up while the LLM lives,
    is thawed): each LLM built and dropped in one process had kept its model, some 0.5 GB, until exit."""
    import gc
    import weakref

    llm = LLM("default", max_model_len=256, num_kv_blocks=16, dtype="float32")
    assert (
        len(llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)
        == 2
    )
    engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.runner.model)
    del llm
    gc.collect()
    assert engine() is None and model() is None
