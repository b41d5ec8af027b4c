"""`speculative_config` as vLLM spells it: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_min": 1, "prompt_lookup_max": 4}, {"method": "layer_skip", "num_speculative_tokens": k,
"draft_layers": n}, {"method": "draft_model", "num_speculative_tokens": k, "model": path}, or
{"method": "eagle" | "eagle3", "num_speculative_tokens": k, "model": path to the EAGLE head}."""

from __future__ import annotations

from dataclasses import dataclass, fields

_METHODS = ("ngram", "layer_skip", "draft_model", "eagle", "eagle3")
# Methods whose proposer is a model with its own KV cache, at `model`.
_WITH_MODEL = ("draft_model", "eagle", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the proposer looks for the request's last n tokens earlier in its own text, for n from
    # prompt_lookup_max down to prompt_lookup_min, and proposes what followed the latest match.
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
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
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}.")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in _METHODS:
            raise ValueError(f"speculative_config method must be one of {_METHODS}, got {self.method!r}.")
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 1
        ):
            raise ValueError(
                "speculative_config disable_by_batch_size must be a positive integer, got "
                f"{self.disable_by_batch_size!r}."
            )
        if not isinstance(self.min_acceptance, (int, float)) or not 0.0 <= self.min_acceptance <= 1.0:
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
