"""`tokenmill generate` and `tokenmill chat` print what the offline engine generates."""

from __future__ import annotations

import pytest

from tokenmill import SamplingParams
from tokenmill.entrypoints import generate_cli
from tokenmill.entrypoints.cli import main

from .conftest import one_thread


@pytest.fixture
def shared_engine(default_llm, monkeypatch):
    """The CLI builds its engine from the options; hand it the already loaded one instead."""
    built = []

    def make_engine(config):
        built.append(config)
        return default_llm.engine

    monkeypatch.setattr(generate_cli, "LLMEngine", make_engine)
    return built


def test_generate_prints_the_greedy_completion(shared_engine, default_llm, capsys):
    with one_thread():
        code = main(
            ["generate", "The sky is", "--max-tokens", "6", "--max-model-len", "512", "--dtype", "fp32"]
        )
        (expected,) = default_llm.generate(
            "The sky is", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
        )
    assert code == 0
    assert capsys.readouterr().out == expected.outputs[0].text + "\n"
    assert shared_engine[0].max_model_len == 512 and shared_engine[0].dtype == "float32"


def test_generate_rejects_bad_sampling_before_loading(shared_engine, capsys):
    assert main(["generate", "x", "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert shared_engine == []


def test_chat_keeps_the_conversation_until_reset(shared_engine, default_llm, capsys, monkeypatch):
    lines = iter(["What is 2+2?", "", "And 3+3?", "/reset", "Name a color.", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    greedy = SamplingParams(temperature=0, max_tokens=8)

    def reply(*turns: str) -> str:
        roles = ["user", "assistant"] * len(turns)  # alternating, longer than needed
        conversation = [{"role": "system", "content": "Be brief."}]
        conversation += [{"role": role, "content": text} for role, text in zip(roles, turns, strict=False)]
        return default_llm.chat(conversation, greedy, use_tqdm=False)[0].outputs[0].text

    with one_thread():
        assert main(["chat", "--temperature", "0", "--max-tokens", "8", "--system", "Be brief."]) == 0
        first = reply("What is 2+2?")
        expected = [first, reply("What is 2+2?", first, "And 3+3?"), reply("Name a color.")]
    assert capsys.readouterr().out == "".join(text + "\n" for text in expected)


def test_chat_ends_on_end_of_input(shared_engine, monkeypatch):
    def no_more_input(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", no_more_input)
    assert main(["chat"]) == 0
