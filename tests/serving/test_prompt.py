"""render_prompt: chat templates and completion prompts become text and token ids in one place."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from tokenmill.serving.prompt import RenderedPrompt, render_prompt

WORDS = ["<s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "hello", "there", "how", "are", "you"]
# The template writes the BOS token itself, as Llama's and Mistral's do.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose encode adds a BOS token, like Llama's."""
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
        chat_template=TEMPLATE,
    )


def test_chat_is_rendered_and_tokenized_with_one_bos(tokenizer) -> None:
    text, token_ids = render_prompt(tokenizer, messages=HELLO)
    assert text == "<s><|user|> hello there <|end|> <|assistant|>"
    assert token_ids == [0, 2, 5, 6, 4, 3]  # one BOS: the template's, none added by encode


def test_chat_options_reach_the_template(tokenizer) -> None:
    assert render_prompt(tokenizer, messages=HELLO, add_generation_prompt=False).token_ids == [0, 2, 5, 6, 4]
    other = render_prompt(
        tokenizer, messages=HELLO, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert other == RenderedPrompt("hello there", [5, 6])
    partial = [*HELLO, {"role": "assistant", "content": "how are"}]
    continued = render_prompt(
        tokenizer, messages=partial, add_generation_prompt=False, continue_final_message=True
    )
    assert continued.text.endswith("<|assistant|> how are") and continued.token_ids[-2:] == [7, 8]


def test_completion_text_gets_special_tokens_unless_told_not_to(tokenizer) -> None:
    assert render_prompt(tokenizer, "how are you") == RenderedPrompt("how are you", [0, 7, 8, 9])
    assert render_prompt(tokenizer, "how are you", add_special_tokens=False).token_ids == [7, 8, 9]


def test_token_ids_pass_through_untouched(tokenizer) -> None:
    assert render_prompt(tokenizer, (9, 8, 7)) == RenderedPrompt(None, [9, 8, 7])
    assert render_prompt(None, [3, 1]) == RenderedPrompt(None, [3, 1])  # no tokenizer needed


def test_without_a_tokenizer_text_and_chat_name_the_knob() -> None:
    with pytest.raises(ValueError, match="prompt must be token ids when skip_tokenizer_init=True"):
        render_prompt(None, "hello")
    with pytest.raises(ValueError, match="chat needs a tokenizer; drop skip_tokenizer_init=True"):
        render_prompt(None, messages=HELLO)


def test_bad_calls_are_value_errors(tokenizer) -> None:
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        render_prompt(tokenizer, "hello", messages=HELLO)
    with pytest.raises(ValueError, match="exactly one of prompt or messages"):
        render_prompt(tokenizer)
    strict = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="the chat template rejected these messages: roles must alternate"):
        render_prompt(tokenizer, messages=HELLO, chat_template=strict)
