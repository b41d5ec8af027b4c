"""Tokenizers embedded in GGUF files (SentencePiece "llama" and byte-level BPE "gpt2" vocabularies): the
BOS the file asks for, and the chat template, from the file alone and again from the conversion cache."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest

from tokenmill.loader.gguf import load_gguf_tokenizer

# A SentencePiece vocabulary as llama.cpp's converter stores one: scores, token types (2 unknown,
# 3 control, 6 byte fallback, 1 normal), no merges.
PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "he", "ll", "▁w", "or", "ld", "▁t", "▁the"]
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)] + PIECES
SPM_SCORES = [0.0] * 259 + [-float(rank) for rank in range(len(PIECES))]
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(PIECES)
TEMPLATE = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def write_spm_vocab(path: Path, add_bos: bool | None) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPM_TOKENS)
    writer.add_token_scores(SPM_SCORES)
    writer.add_token_types(SPM_TYPES)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(("add_bos", "bos"), [(None, [1]), (True, [1]), (False, [])])
def test_sentencepiece_vocabulary_adds_the_bos_the_file_asks_for(
    tmp_path: Path, add_bos: bool | None, bos: list[int]
) -> None:
    path = tmp_path / "spm.gguf"
    write_spm_vocab(path, add_bos)
    pieces = ["▁", "he", "ll", "o", "▁w", "or", "ld", "▁the"]
    expected = bos + [SPM_TOKENS.index(piece) for piece in pieces]
    for _ in ("converted", "from the cache"):
        tokenizer = load_gguf_tokenizer(str(path))
        assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
        ids = tokenizer.encode("hello world the")
        assert ids == expected
        assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world the"
        # The template writes its own BOS: it is not added a second time.
        messages = [{"role": "user", "content": "hello"}]
        assert tokenizer.apply_chat_template(messages, tokenize=False) == "<s>[INST] hello [/INST]"
        chat = tokenizer.apply_chat_template(messages, return_dict=False)
        assert chat[0] == 1 and chat.count(1) == 1


def write_bpe_vocab(path: Path, add_bos: bool) -> list[str]:
    """A byte-level BPE vocabulary trained on a few sentences, stored as a Llama 3 GGUF stores its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 8, trainer)
    vocab = bpe.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in specials else 1 for token in tokens])
    merges = json.loads(bpe.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in merges])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


@pytest.mark.parametrize("add_bos", [True, False])
def test_bpe_vocabulary_adds_the_bos_the_file_asks_for(tmp_path: Path, add_bos: bool) -> None:
    path = tmp_path / "bpe.gguf"
    tokens = write_bpe_vocab(path, add_bos)
    for _ in ("converted", "from the cache"):
        tokenizer = load_gguf_tokenizer(str(path))
        assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
        ids = tokenizer.encode("hello world")
        assert [tokens[i] for i in ids] == ["<|begin_of_text|>"] * add_bos + ["hello", "Ġworld"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world"
