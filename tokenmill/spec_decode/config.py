"""`speculative_config` as vLLM spells it: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 1, "prompt_lookup_max": 4}, {"method": "layer_skip", "num_speculative_tokens": k,
"draft_layers": n}, {"method": "draft_model", "num_speculative_tokens": k, "model": path}, or
{"method": "eagle" | "eagle3", "num_speculative_tokens": k, "model": path to the EAGLE head}; without a
method, vLLM's inference from the model ("ngram", an EAGLE name or architecture, else a draft model)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

_METHODS = ("ngram", "layer_skip", "draft_model", "eagle", "eagle3")
# Methods whose proposer is a model with its own KV cache, at `model`.
_WITH_MODEL = ("draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the proposer looks for the request's last n tokens earlier in its own text, for n from
    # prompt_lookup_max down to prompt_lookup_min, and proposes what followed the latest match. As in
    # vLLM: one left out takes the other's value, both left out are 5.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # layer_skip: the target's first draft_layers layers, its final norm and its LM head draft (greedy)
    # for the whole model; they share the target's weights and its KV cache.
    draft_layers: int | None = None
    # draft_model: a smaller model with the same tokenizer (a directory, a .gguf or "default"), run by the
    # same engine with its own KV cache in the same blocks; it drafts greedily.
    # eagle / eagle3: the EAGLE head's directory (config.json and its weights; models/eagle.py).
    model: str | None = None
    # Dynamic speculation. A step with at least this many running requests verifies no drafts (vLLM's
    # speculative_disable_by_batch_size): from there decode is compute-bound and drafts cost what
    # they save. None: every batch size speculates.
    disable_by_batch_size: int | None = None
    # A request whose recent drafts were accepted less often than this (a running average over its
    # verifying steps) stops taking drafts, and tries one step of them again every PROBE_INTERVAL
    # steps. 0: never. On the CPU, 0.2 cost more than it saved (docs/speculative.md), so it is off
    # until a cost model sets it.
    min_acceptance: float = 0.0
    # vLLM's draft tensor parallel size: the drafter runs on the target's ranks, so only the target's
    # tensor_parallel_size (checked by EngineConfig).
    draft_tensor_parallel_size: int | None = None
    # vLLM's max_model_len of the draft: no drafts are verified at positions from here on (a request
    # this long decodes one token a step). None: the target's.
    max_model_len: int | None = None

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """From a dict (LLM(speculative_config=...), the --speculative-config JSON); ValueError naming
        the key on anything it does not take."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}.")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens'.")
        value = dict(value)
        method = value.get("method")
        value["method"] = _infer_method(value.get("model")) if method is None else method
        if method == "[ngram]":
            value["method"] = "ngram"
        if value["method"] == "ngram" and value.get("model") in _NGRAM_MODELS:
            del value["model"]  # vLLM's own spelling of "no model"
        return cls(**value)

    def __post_init__(self) -> None:
        if self.prompt_lookup_min is None:
            default = 5 if self.prompt_lookup_max is None else self.prompt_lookup_max
            object.__setattr__(self, "prompt_lookup_min", default)
        if self.prompt_lookup_max is None:
            object.__setattr__(self, "prompt_lookup_max", self.prompt_lookup_min)
        if self.method not in _METHODS:
            raise ValueError(f"speculative_config method must be one of {_METHODS}, got {self.method!r}.")
        for key in ("disable_by_batch_size", "draft_tensor_parallel_size", "max_model_len"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"speculative_config {key} must be a positive integer, got {value!r}.")
        if (
            not isinstance(self.min_acceptance, (int, float))
            or isinstance(self.min_acceptance, bool)
            or not 0.0 <= self.min_acceptance <= 1.0
        ):
            raise ValueError(
                f"speculative_config min_acceptance must be in [0, 1], got {self.min_acceptance!r}."
            )
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {key} must be a positive integer, got {value!r}.")
        if self.method == "layer_skip":
            if (
                not isinstance(self.draft_layers, int)
                or isinstance(self.draft_layers, bool)
                or self.draft_layers < 1
            ):
                raise ValueError(
                    f"speculative_config method 'layer_skip' needs draft_layers, a positive integer (the "
                    f"target's layers that draft), got {self.draft_layers!r}."
                )
        elif self.draft_layers is not None:
            raise ValueError("speculative_config draft_layers applies to method 'layer_skip' only.")
        if self.method in _WITH_MODEL:
            if not isinstance(self.model, str) or not self.model:
                what = (
                    "the draft model's path" if self.method == "draft_model" else "the EAGLE head's directory"
                )
                raise ValueError(f"speculative_config method {self.method!r} needs model, {what}.")
        elif self.model is not None:
            raise ValueError(f"speculative_config model applies to methods {_WITH_MODEL} only.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                f"prompt_lookup_max ({self.prompt_lookup_max})."
            )

    @property
    def lookahead(self) -> int:
        """KV slots a request needs past the tokens it computes, for drafts the worker writes into the
        cache before the next step (the model-based methods); 0 for n-gram, which reads no model."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens


_NGRAM_MODELS = ("ngram", "[ngram]")


def _infer_method(model: object) -> str:
    """vLLM's method for a config without one: "ngram" for the model "ngram"; an EAGLE head by its name
    ("eagle-" or "eagle3" in it) or by its config.json's architectures; any other model a draft model."""
    if model is None:
        raise ValueError("speculative_config needs 'method', or a 'model' to infer it from.")
    if not isinstance(model, str):
        return "draft_model"  # refused by name when the config is built
    if model in _NGRAM_MODELS:
        return "ngram"
    name = model.lower()
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    config_file = os.path.join(model, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            architectures = " ".join(json.load(f).get("architectures") or []).lower()
        if "eagle3" in architectures:
            return "eagle3"
        if "eagle" in architectures:
            return "eagle"
    return "draft_model"
