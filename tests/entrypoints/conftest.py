"""The embedded SmolLM2 model loaded once in the test process, with one torch thread (as the server's engine
core runs on a small CPU box), for the offline-vs-server comparisons and the CLI tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tokenmill import LLM


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    with one_thread():
        return LLM("default", max_model_len=1024, num_kv_blocks=64, dtype="float32")  # as the test server
