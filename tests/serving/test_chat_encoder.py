"""ChatEncoder: a rendered chat's token ids from cached pieces equal tokenizing the whole text, and the
cache turns itself off for tokenizers whose pieces interact."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tokenmill.serving import chat_encoder as chat_encoder_module
from tokenmill.serving.chat_encoder import ChatEncoder
from tokenmill.serving.prompt import render_prompt


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from tokenmill.loader import resolve_model

    return resolve_model("default").load_tokenizer()


def whole(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_every_turn_of_a_growing_conversation_tokenizes_as_the_whole_text(smollm_tokenizer) -> None:
    encoder = ChatEncoder(smollm_tokenizer)
    assert encoder.enabled
    messages = [{"role": "system", "content": "Be brief and exact.  Numbers as digits.\n"}]
    for turn in range(8):
        messages = [*messages, {"role": "user", "content": f" Turn {turn}: what's {turn} x {turn}?\t né"}]
        want = render_prompt(smollm_tokenizer, messages=messages)
        got = render_prompt(smollm_tokenizer, messages=messages, encode=encoder.encode)
        assert got == want, turn
        messages = [*messages, {"role": "assistant", "content": f"{turn * turn}.\n\n"}]
    assert encoder.enabled and len(encoder._pieces) > 8
    # Each earlier message is one cached piece: the next turn tokenizes only what it adds.
    calls, batches = [], []
    real = smollm_tokenizer.encode
    backend = smollm_tokenizer.backend_tokenizer

    class CountingBackend:
        def encode_batch(self, texts, add_special_tokens=True):
            calls.extend(texts)
            batches.append(len(texts))
            return backend.encode_batch(texts, add_special_tokens=add_special_tokens)

    class Counting:
        backend_tokenizer = CountingBackend()

        def __getattr__(self, name):
            return getattr(smollm_tokenizer, name)

        def encode(self, text, add_special_tokens=True):
            calls.append(text)
            return real(text, add_special_tokens=add_special_tokens)

    encoder.tokenizer = Counting()
    messages = [*messages, {"role": "user", "content": "A new question."}]
    want = render_prompt(smollm_tokenizer, messages=messages)
    assert render_prompt(smollm_tokenizer, messages=messages, encode=encoder.encode) == want
    assert calls and all("Turn" not in text for text in calls)  # earlier turns came from the cache
    # A conversation seen first: its pieces go to the tokenizer's backend in one batch, ids unchanged.
    calls.clear()
    messages = [{"role": "system", "content": "Other rules."}, {"role": "user", "content": "Other question?"}]
    want = render_prompt(smollm_tokenizer, messages=messages)
    assert render_prompt(smollm_tokenizer, messages=messages, encode=encoder.encode) == want
    assert any("Other rules." in text for text in calls) and any("Other question?" in text for text in calls)
    assert batches and max(batches) >= 2


def test_the_cache_keeps_at_most_its_token_budget(smollm_tokenizer) -> None:
    encoder = ChatEncoder(smollm_tokenizer, max_cached_tokens=40)
    for i in range(30):
        text = f"<|im_start|>user\nquestion number {i} about things<|im_end|>\n<|im_start|>assistant\n"
        assert encoder.encode(text) == whole(smollm_tokenizer, text)
        assert encoder._cached_tokens <= 40
    assert encoder.enabled
    with pytest.raises(ValueError, match="max_cached_tokens"):
        ChatEncoder(smollm_tokenizer, max_cached_tokens=-1)


def metaspace_tokenizer(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer with a Metaspace pre-tokenizer, as sentencepiece conversions have."""
    chars = sorted(set("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\n\téöü"))
    vocab = {"<unk>": 0, "<s>": 1, "[INST]": 2, "[/INST]": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme), pre_tokenizers.Split("", "isolated")]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        unk_token="<unk>",
        additional_special_tokens=["[INST]", "[/INST]"],
    )


def test_a_tokenizer_that_prepends_to_its_first_piece_only_is_tokenized_whole() -> None:
    first = metaspace_tokenizer("first")
    text = "<s>[INST]hello there[/INST]fine, thanks"
    # Whole, "hello" is not the text's start and gets no "▁"; alone it would.
    assert whole(first, text)[2] != whole(first, "hello there")[0]
    encoder = ChatEncoder(first)
    assert not encoder.enabled  # found by the probe, before any prompt
    assert encoder.encode(text) == whole(first, text)

    always = ChatEncoder(metaspace_tokenizer("always"))
    assert always.enabled
    assert always.encode(text) == whole(always.tokenizer, text)


def test_a_text_whose_pieces_interact_after_the_probe_is_caught_by_the_sampled_check(monkeypatch) -> None:
    class Odd:
        """Pieces add up, except for a text holding "zz": there, one id per text, its length."""

        added_tokens_decoder = {0: type("T", (), {"content": "<s>", "special": True, "lstrip": False,
                                                  "rstrip": False, "normalized": False})()}  # fmt: skip

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            if "zz" in text and "<s>" in text:
                return [len(text)]
            return [0 if piece == "<s>" else ord(piece) for piece in _split(text)]

    def _split(text: str) -> list[str]:
        out, rest = [], text
        while rest:
            if rest.startswith("<s>"):
                out.append("<s>")
                rest = rest[3:]
            else:
                out.append(rest[0])
                rest = rest[1:]
        return out

    encoder = ChatEncoder(Odd())
    assert encoder.enabled
    assert encoder.encode("ab<s>cd") == [97, 98, 0, 99, 100]
    monkeypatch.setattr(chat_encoder_module, "CHECK_EVERY", 1)
    assert encoder.encode("zz<s>cd") == [7] and not encoder.enabled  # checked, turned off
    assert encoder.encode("zz<s>cd") == [7]


def test_threads_sharing_one_encoder_get_the_whole_texts_ids(smollm_tokenizer) -> None:
    """The router hashes large bodies on worker threads through one encoder: with a tokenizer that lets
    other threads run while it works and a cache small enough to evict all the time, every thread gets
    each text's own ids and the cache's token count stays true."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    class Slow:
        def __getattr__(self, name):
            return getattr(smollm_tokenizer, name)

        def encode(self, text, add_special_tokens=True):
            time.sleep(0.001)  # the GIL is free meanwhile, as it is for a tokenizer that releases it
            return smollm_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    encoder = ChatEncoder(Slow(), max_cached_tokens=64)
    texts = [
        f"<|im_start|>system\nrule {i % 5}: be exact<|im_end|>\n<|im_start|>user\nask {i % 7}<|im_end|>\n"
        for i in range(300)
    ]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(encoder.encode, texts))
    assert got == [whole(smollm_tokenizer, text) for text in texts]
    assert encoder.enabled
    assert encoder._cached_tokens == sum(len(ids) for ids in encoder._pieces.values()) <= 64
