"""Where a model comes from: the embedded default, a Hugging Face directory, a GGUF file, or dummy weights
of a named shape. resolve_model() turns the user's `model` string into a ModelSource."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing the package stays cheap: plan and bench use default_model without torch
    import torch


@dataclass
class ModelSource:
    path: str
    format: str  # "safetensors" | "gguf" | "dummy"
    hf_config: object
    tokenizer_path: str | None = None

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.format == "gguf":
            from tokenmill.loader.gguf import iter_gguf_weights

            return iter_gguf_weights(self.path)
        from tokenmill.loader.hf import iter_safetensors_weights

        return iter_safetensors_weights(self.path)

    def load_tokenizer(self):
        path = self.tokenizer_path or self.path
        if path.endswith(".gguf"):
            from tokenmill.loader.gguf import load_gguf_tokenizer

            return load_gguf_tokenizer(path)
        from tokenmill.loader.hf import load_hf_tokenizer

        return load_hf_tokenizer(path)

    def sentence_transformers_pooling(self) -> str | None:
        """The pooling a sentence-transformers checkpoint declares (modules.json and its Pooling module's
        config.json): "last", "mean", or None when the directory has no such config."""
        if self.format == "gguf" or not os.path.isdir(self.path):
            return None
        from tokenmill.loader.hf import sentence_transformers_pooling

        return sentence_transformers_pooling(self.path)

    def eos_token_ids(self, tokenizer=None) -> tuple[int, ...]:
        """The config's EOS ids, plus generation_config.json's (instruct models often add e.g. Llama 3's
        <|eot_id|>) and the tokenizer's own."""
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        if self.format != "gguf" and os.path.isdir(self.path):
            from tokenmill.loader.hf import generation_eos_ids

            ids += generation_eos_ids(self.path)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))


def resolve_model(model: str | None, load_format: str = "auto", tokenizer: str | None = None) -> ModelSource:
    from tokenmill.loader.default_model import DEFAULT_MODEL, default_model_path

    if model in (None, "", DEFAULT_MODEL):
        model = default_model_path()
    if tokenizer == DEFAULT_MODEL:  # the embedded model's tokenizer, as `bench --tokenizer default` reads it
        tokenizer = default_model_path()
    if not os.path.exists(model):
        raise ValueError(
            f"model {model!r} not found: pass 'default', a Hugging Face model directory (with config.json) "
            "or a .gguf file."
        )
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file.")
        from tokenmill.loader.gguf import load_gguf_config

        fmt = "dummy" if load_format == "dummy" else "gguf"
        return ModelSource(model, fmt, load_gguf_config(model), tokenizer)
    gguf_file = _gguf_in_directory(model) if load_format != "safetensors" else None
    if gguf_file is not None:
        from tokenmill.loader.gguf import load_gguf_config

        # The directory's own tokenizer (the original checkpoint's, when one sits beside the GGUF) before
        # the one transformers rebuilds from the GGUF's vocabulary.
        if tokenizer is None and any(os.path.isfile(os.path.join(model, f)) for f in _TOKENIZER_FILES):
            tokenizer = model
        fmt = "dummy" if load_format == "dummy" else "gguf"
        return ModelSource(gguf_file, fmt, load_gguf_config(gguf_file), tokenizer)
    if not os.path.exists(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json (nor a .gguf file).")
    if load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, got the directory {model!r}.")
    from tokenmill.loader.hf import load_hf_config

    fmt = "dummy" if load_format == "dummy" else "safetensors"
    return ModelSource(model, fmt, load_hf_config(model), tokenizer)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _gguf_in_directory(directory: str) -> str | None:
    """The GGUF model a directory without safetensors weights holds (one file, or the first shard of a
    split one), None when it holds none; a ValueError when it holds several (several quantizations)."""
    from tokenmill.loader.gguf_file import first_shard

    names = os.listdir(directory)
    if any(name.endswith(".safetensors") for name in names):
        return None
    models = sorted({first_shard(os.path.join(directory, name)) for name in names if name.endswith(".gguf")})
    if len(models) > 1:
        listed = ", ".join(os.path.basename(path) for path in models)
        raise ValueError(
            f"model directory {directory!r} holds several GGUF models ({listed}): pass one file."
        )
    return models[0] if models else None
