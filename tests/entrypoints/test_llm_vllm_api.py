"""The offline LLM as vLLM scripts call it, on the embedded SmolLM2: vLLM's argument names and prompt
forms, the SamplingParams knobs that change what is generated, and vLLM's attribute names on the LLM
and its outputs."""

from __future__ import annotations

import pytest
from tqdm.auto import tqdm

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="default", max_model_len=256, max_num_seqs=8, dtype="float32")


def test_chat_takes_vllms_template_arguments(llm):
    template = "{% for m in messages %}{{ greeting }} {{ m['content'] }}\n{% endfor %}"
    out = llm.chat(
        CHAT, GREEDY, use_tqdm=False, chat_template=template, chat_template_kwargs={"greeting": "Hi!"}
    )[0]
    assert out.prompt == "Hi! What is the capital of France?\n"
    # vLLM's order: lora_request, then chat_template, after use_tqdm.
    positional = llm.chat(CHAT, GREEDY, False, None, template, chat_template_kwargs={"greeting": "Hi!"})[0]
    assert positional.prompt == out.prompt


def test_chat_joins_openai_text_parts_as_vllm_does(llm):
    parts = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital"},
                {"type": "text", "text": "of France?"},
            ],
        }
    ]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    assert (
        llm.chat(parts, GREEDY, use_tqdm=False)[0].prompt
        == llm.chat(joined, GREEDY, use_tqdm=False)[0].prompt
    )
    with pytest.raises(ValueError, match="of type 'text'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(CHAT, GREEDY, chat_template_content_format="markdown")


def test_lora_request_none_is_taken_and_an_adapter_refused(llm):
    assert len(llm.generate("Hello", GREEDY, lora_request=None, use_tqdm=False)) == 1
    assert len(llm.chat(CHAT, GREEDY, lora_request=None, use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate("Hello", GREEDY, lora_request=object(), use_tqdm=False)


def test_a_flat_token_id_list_is_one_prompt(llm):
    ids = llm.get_tokenizer().encode("Once upon a time")
    want = llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    for outputs in (
        llm.generate(ids, GREEDY, use_tqdm=False),
        llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False),
    ):
        assert len(outputs) == 1 and outputs[0].outputs[0].token_ids == want


def test_use_tqdm_may_be_a_progress_bar_class(llm):
    made = []

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["total"])
            super().__init__(*args, **kwargs)

    llm.generate(["a", "b"], GREEDY, use_tqdm=Bar)
    assert made == [2]


def test_detokenize_false_gives_token_ids_without_text(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    text = llm.generate("The sky is", params, use_tqdm=False)[0]
    params.detokenize = False
    ids_only = llm.generate("The sky is", params, use_tqdm=False)[0]
    completion = ids_only.outputs[0]
    assert completion.token_ids == text.outputs[0].token_ids and text.outputs[0].text
    assert completion.text == ""
    assert all(lp.decoded_token is None for entry in completion.logprobs for lp in entry.values())
    assert all(lp.decoded_token is None for entry in ids_only.prompt_logprobs[1:] for lp in entry.values())


def test_allowed_token_ids_limit_what_is_sampled(llm):
    tokenizer = llm.get_tokenizer()
    allowed = [tokenizer.encode(" yes")[0], tokenizer.encode(" no")[0]]
    for temperature in (0, 1.0):
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=3, allowed_token_ids=allowed)
        out = llm.generate("Is the sky green? Answer:", params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 8 and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids must be in"):
        llm.generate("x", SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    prompt = "one two three four five six seven eight nine ten"
    full = llm.get_tokenizer().encode(prompt)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, truncate_prompt_tokens=4)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.prompt_token_ids == full[-4:]
    assert (
        out.outputs[0].token_ids
        == llm.generate({"prompt_token_ids": full[-4:]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )
    params.truncate_prompt_tokens = -1  # max_model_len: all of a prompt that fits
    assert llm.generate(prompt, params, use_tqdm=False)[0].prompt_token_ids == full


def test_vllms_attribute_names(llm):
    assert llm.llm_engine is llm.engine
    out = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.encoder_prompt_token_ids) == (None,) * 4
    # vLLM's CompletionOutput.finished is a method (RequestOutput.finished a field).
    assert out.finished is True and out.outputs[0].finished() is True
