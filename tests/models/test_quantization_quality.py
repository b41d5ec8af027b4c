"""Quantization quality on a real model: the embedded SmolLM2-135M scores a fixed text of ~1,900 tokens
(tests/data/perplexity.txt, written for this project) under each scheme; perplexity may grow at most as
far as issue 11 allows (FP8 W8A8: +3%)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import LLM
from tokenmill.bench.perplexity import perplexity

TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    llm = LLM("default", max_model_len=4096, num_kv_blocks=300, dtype="float32")
    ids = llm.engine.input_processor.tokenizer.encode(TEXT.read_text())
    assert 1800 <= len(ids) <= 2100
    return ids


@pytest.fixture(scope="module")
def baseline(token_ids: list[int]) -> float:
    return perplexity(LLM("default", max_model_len=4096, num_kv_blocks=300, dtype="float32"), token_ids)


def test_the_text_is_ordinary_english_to_the_model(baseline: float) -> None:
    assert 5 < baseline < 60  # a 135M model on plain prose; random tokens would score in the thousands


def test_fp8_weights_and_activations_within_3_percent(token_ids: list[int], baseline: float) -> None:
    llm = LLM("default", max_model_len=4096, num_kv_blocks=300, dtype="float32", quantization="fp8")
    assert perplexity(llm, token_ids) <= 1.03 * baseline
