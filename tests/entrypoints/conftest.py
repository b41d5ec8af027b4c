"""The embedded SmolLM2 model loaded once in the test process, for the offline-vs-server comparisons (with
as many torch threads as the shared server's core) and the CLI tests (with one, as the CLI's engine core
runs on a small CPU box)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from tokenmill import LLM


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread() -> contextlib.AbstractContextManager[None]:
    return torch_threads(1)


def server_threads() -> contextlib.AbstractContextManager[None]:
    """As many threads as the shared server's core: same kernels, same rounding."""
    from tests.entrypoints.openai.conftest import MAIN_SERVER_THREADS

    return torch_threads(MAIN_SERVER_THREADS)


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    with one_thread():
        return LLM("default", max_model_len=1024, num_kv_blocks=64, dtype="float32")  # as the test server
