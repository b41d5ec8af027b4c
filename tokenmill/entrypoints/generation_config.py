"""The default sampling parameters of requests that leave them unset, taken from the model's
generation_config.json as vLLM takes them (`--generation-config auto|vllm|DIR`,
`--override-generation-config`); the server and the offline LLM both start from these."""

from __future__ import annotations

import json
import os

from tokenmill.config import EngineConfig
from tokenmill.loader.default_model import DEFAULT_MODEL
from tokenmill.sampling_params import SamplingParams

# The generation-config keys vLLM reads as sampling defaults; Hugging Face's max_new_tokens is max_tokens.
_SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def default_sampling_params(config: EngineConfig) -> dict[str, float | int]:
    """{SamplingParams field: value} of every sampling key the generation config sets (none with
    generation_config 'vllm'), override_generation_config's values on top; a bad value is a ValueError
    naming the key."""
    source = {} if config.generation_config == "vllm" else _read(config)
    source.update(config.override_generation_config or {})
    defaults = {key: source[key] for key in _SAMPLING_KEYS if source.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:
        SamplingParams(**defaults)  # type: ignore[arg-type]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the generation config's sampling defaults {defaults}: {exc}") from None
    return defaults


def _read(config: EngineConfig) -> dict:
    """The generation_config.json that applies: the one given, else the model directory's (a GGUF file or
    the embedded model has none)."""
    directory = config.model if config.generation_config == "auto" else config.generation_config
    if directory in (None, "", DEFAULT_MODEL) or not os.path.isdir(directory):
        return {}
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as file:
            values = json.load(file)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path} ({exc}); pass --generation-config vllm to ignore it.") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not a JSON object; pass --generation-config vllm to ignore it.")
    return values


def describe(defaults: dict[str, float | int]) -> str:
    """The start-up log line saying where requests' defaults come from."""
    return (
        f"default sampling parameters from the generation config: {defaults} (a request's own values "
        "win, its max_tokens capped by this one; --generation-config vllm ignores the model's)"
    )
