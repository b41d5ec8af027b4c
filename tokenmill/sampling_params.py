"""SamplingParams: every per-request generation knob, validated once when constructed."""

from __future__ import annotations

import copy
import enum
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
# vLLM's floor for a temperature above 0: dividing logits by less can overflow them (inf, then nan).
_MIN_TEMPERATURE = 1e-2

logger = logging.getLogger(__name__)
_DEFAULTED_WHEN_NONE = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
)


# The reasoning parsers (`<think>...</think>`) the server and the constraints know.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# What a rendered chat prompt did with the thinking (tokenmill.thinking.prompt_thinking).
PROMPT_THINKING = ("open", "closed")


class KnobError(ValueError):
    """A bad value of one knob, named in `param` (the server's 400 names it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# The constraints a StructuredOutputsParams gives one of (beside json_object, a flag).
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's `structured_outputs`): exactly one of a JSON
    schema (`json`, a dict or its text), any JSON object (`json_object`), a regular expression (`regex`),
    one of a list of strings (`choice`) or a Lark grammar as llguidance reads it (`grammar`). `reasoning`
    (a reasoning parser's name, deepseek_r1 or qwen3; the OpenAI server sets it from --reasoning-parser):
    the model's thinking (`<think>...</think>`, as that parser reads it) goes free, the constraint applies
    to the answer after it, as vLLM's structured outputs with a reasoning parser do. `prompt_thinking`
    ("open", "closed" or None; the chat endpoint and LLM.chat set it from the rendered prompt): the chat
    template opened the thinking (the output starts inside it) or closed it (no thinking: the constraint
    applies from the first token); None leaves it to the parser's rule."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # vLLM's structural tag: free text in which each trigger ("<function=") opens a structure, `begin`,
    # JSON under its `schema`, `end`; {"structures": [...], "triggers": [...]} or its JSON text.
    structural_tag: dict | str | None = None
    # vLLM's options of the JSON written under json, json_object and structural_tag: a regex for the
    # whitespace JSON may hold (else compact, `{"a": 1, "b": [2, 3]}`); compact JSON and closed objects,
    # which this server writes anyway, asked for by name.
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning: str | None = None
    prompt_thinking: str | None = None

    def __post_init__(self) -> None:
        # The flags travel to the engine core as bools: anything else (a JSON null, "yes") would fail
        # there, for every request of the step, not here for this one.
        for name in ("json_object", "disable_any_whitespace", "disable_additional_properties"):
            value = getattr(self, name)
            if value is None:  # vLLM's default for json_object, and a client's null
                setattr(self, name, False)
            elif not isinstance(value, bool):
                raise ValueError(f"structured_outputs {name} must be true or false, got {value!r}.")
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must give exactly one of json, json_object, regex, choice, grammar or "
                f"structural_tag, got {given or 'none'}."
            )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs choice must be a non-empty list of strings, got {self.choice!r}."
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}.")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object), got {self.json!r}.")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (dict, str)):
            raise ValueError(
                "structured_outputs structural_tag must be an object or its JSON text, "
                f"got {self.structural_tag!r}."
            )
        self._check_json_options()
        if self.reasoning is not None and self.reasoning not in REASONING_PARSERS:
            raise ValueError(
                f"structured_outputs reasoning must be one of {REASONING_PARSERS} (or None), "
                f"got {self.reasoning!r}."
            )
        if self.prompt_thinking is not None and self.prompt_thinking not in PROMPT_THINKING:
            raise ValueError(
                f"structured_outputs prompt_thinking must be one of {PROMPT_THINKING} (or None), "
                f"got {self.prompt_thinking!r}."
            )

    def _check_json_options(self) -> None:
        pattern = self.whitespace_pattern
        if pattern is None:
            return
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(
                f"structured_outputs whitespace_pattern must be a non-empty regex, got {pattern!r}."
            )
        if self.kind not in ("json", "json_object", "structural_tag"):
            raise ValueError(
                "structured_outputs whitespace_pattern shapes JSON (json, json_object, structural_tag), not "
                f"a {self.kind}."
            )
        if self.disable_any_whitespace:
            raise ValueError(
                "structured_outputs: give whitespace_pattern or disable_any_whitespace, not both."
            )

    @property
    def kind(self) -> str:
        for name in _CONSTRAINTS:
            if getattr(self, name) is not None:
                return name
        return "json_object"


# vLLM's older name for the same constraint (SamplingParams(guided_decoding=GuidedDecodingParams(...))).
GuidedDecodingParams = StructuredOutputsParams


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a streaming request holds (vLLM's enum). The offline LLM returns only
    the finished output, whatever a request says, as vLLM's LLM does."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older spelling of structured_outputs; moved there when constructed.
    guided_decoding: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len)
    detokenize: bool = True  # False: no text (output.text stays ""), token ids only
    # Changes nothing here: tokenmill's tokenizers are all fast ones, which vLLM's detokenizer does not
    # give this knob to either.
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    best_of: int | None = None  # vLLM V1's rule: only None or n (no best-of ranking)
    extra_args: dict[str, Any] | None = None  # kept for custom code; read by nothing here, as in vLLM
    bad_words: list[str] | None = None  # refused unless empty: see _validate

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise KnobError(
                    "guided_decoding", "give structured_outputs or guided_decoding (its old name), not both."
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop, "a string or a list of non-empty strings")
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.allowed_token_ids is not None:
            rule = "a non-empty list of token ids >= 0"
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids, rule)
        self._check_types()
        if self.top_k == -1:
            self.top_k = 0
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if isinstance(self.temperature, (int, float)) and 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s, which can overflow the scaled logits; raised to %s (as vLLM "
                "does; 0 is greedy)", self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE,
            )  # fmt: skip
            self.temperature = _MIN_TEMPERATURE
        self._validate()

    def _check_types(self) -> None:
        """The numeric knobs are numbers (a string or None is named here, not met as a TypeError in a
        comparison; a bool is not taken for 0 or 1; NaN and infinities are refused), logit_bias a dict of
        token ids to finite numbers. Numbers of other types (numpy's scalars) become Python's, as the
        engine core's messages carry them."""
        for knob in _REAL_KNOBS:
            value = getattr(self, knob)
            if not _is_real(value) or not math.isfinite(value):
                raise KnobError(knob, f"{knob} must be a finite number, got {value!r}.")
            setattr(self, knob, float(value))
        for knob in _INT_KNOBS + _OPTIONAL_INT_KNOBS:
            value = getattr(self, knob)
            if (value is not None or knob in _INT_KNOBS) and not _is_integer(value):
                raise KnobError(knob, f"{knob} must be an integer, got {value!r}.")
            setattr(self, knob, None if value is None else int(value))
        bias = self.logit_bias
        if bias is not None:
            if (
                not isinstance(bias, dict)
                or any(not _is_integer(t) or t < 0 for t in bias)
                or any(not _is_real(b) or not math.isfinite(b) for b in bias.values())
            ):
                raise KnobError(
                    "logit_bias", f"logit_bias must map token ids to finite numbers, got {bias!r}."
                )
            self.logit_bias = {int(t): float(b) for t, b in bias.items()}

    def _validate(self) -> None:
        def bad(knob: str, value: object, rule: str) -> ValueError:
            return KnobError(knob, f"{knob} must be {rule}, got {value!r}.")

        if self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", self.top_k, "0 or -1 (disabled) or a positive integer")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "an integer >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", self.logprobs, "an integer >= 0")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", self.prompt_logprobs, "an integer >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        if self.stop and not self.detokenize:
            raise KnobError("stop", "stop strings need detokenize=True (the text is what they match).")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "a non-empty list of token ids >= 0")
        truncate = self.truncate_prompt_tokens
        if truncate is not None and (truncate < -1 or truncate == 0):
            raise bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 (max_model_len) or >= 1")
        if self.best_of is not None and self.best_of != self.n:
            raise KnobError(
                "best_of",
                f"best_of must be None or equal n={self.n} (no best-of ranking), got {self.best_of}.",
            )
        if self.bad_words:
            raise KnobError(
                "bad_words",
                "bad_words is not supported; ban single tokens with logit_bias={token_id: -100} instead.",
            )

    @staticmethod
    def from_optional(**knobs: Any) -> SamplingParams:
        """vLLM's helper: n, the penalties, temperature and top_p given as None take their defaults; every
        other knob is passed as given (max_tokens=None stays up to the context); logit_bias keys may be
        token ids as text (JSON's), and its values are clipped to [-100, 100]."""
        for name in _DEFAULTED_WHEN_NONE:
            if knobs.get(name, 0) is None:
                del knobs[name]
        if knobs.get("logit_bias"):
            try:
                knobs["logit_bias"] = {
                    int(t): min(100.0, max(-100.0, b)) for t, b in knobs["logit_bias"].items()
                }
            except ValueError as exc:
                raise KnobError("logit_bias", f"logit_bias keys must be token ids, got {exc}") from None
        return SamplingParams(**knobs)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def stop_buffer_length(self) -> int:
        """Characters of text withheld while streaming, so a stop string is never half emitted."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


# Knobs that must be finite numbers, those that must be integers, and those that may also be None.
_REAL_KNOBS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
)  # fmt: skip
_INT_KNOBS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_KNOBS = (
    "max_tokens",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "best_of",
)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_list(knob: str, value: object, rule: str) -> list:
    """A list knob as a list (None is empty); anything but a list or tuple is refused by name."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise KnobError(knob, f"{knob} must be {rule}, got {value!r}.")
    return list(value)


def pooling_request_params(truncate_prompt_tokens: int | None = None) -> SamplingParams:
    """What a request of the pooling runner asks of the scheduler: its whole prompt computed, then one
    step's token, which nobody reads (the step's product is the pooled vector)."""
    return SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=truncate_prompt_tokens
    )
