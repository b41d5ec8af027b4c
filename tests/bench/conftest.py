"""Bench fixtures: a tiny byte-level BPE tokenizer trained in milliseconds, and the fake server."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenmill.bench.datasets import _WORDS
from tokenmill.bench.tokenizer import BenchTokenizer, load_tokenizer

from .fake_openai_server import FakeOpenAIServer, Script


@pytest.fixture(scope="session")
def tiny_tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([" ".join(_WORDS[i : i + 20]) for i in range(0, len(_WORDS), 5)], trainer)
    path = tmp_path_factory.mktemp("tiny_tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_path: Path) -> BenchTokenizer:
    return load_tokenizer(str(tiny_tokenizer_path))


@pytest.fixture
def fake_server() -> Iterator[Callable[[Callable[[dict], Script]], FakeOpenAIServer]]:
    """Start fake servers with a given script; all are stopped at the end of the test."""
    servers: list[FakeOpenAIServer] = []
    # Server and client share the GIL; the default 5 ms switch interval would show up in the timings.
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)

    def start(script_for: Callable[[dict], Script]) -> FakeOpenAIServer:
        server = FakeOpenAIServer(script_for).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)
    sys.setswitchinterval(switch_interval)
