"""Structured outputs with llguidance: a request's constraint (sampling_params.StructuredOutputsParams)
becomes an llguidance grammar, compiled once per distinct constraint and cached; each request holds a
matcher that advances with its tokens. Before a step samples, the scheduler fills one bitmask row (a bit
per vocabulary entry, 32 to an int32) for each constrained request that samples in it, and the worker
sets the logits of the tokens the grammar forbids to -inf before any sampling (worker/sampler.py).

The llguidance tokenizer is built from the model's Hugging Face tokenizer on first use (about a second;
the server builds it at start-up)."""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from tokenmill.sampling_params import StructuredOutputsParams

# Compiled constraints kept, by their text.
_CACHE_SIZE = 512
# JSON as OpenAI's structured outputs write it, {"a": 1, "b": [2, 3]}: no free whitespace, in which a
# small model sampling at temperature can wander until max_tokens; keywords llguidance does not implement
# (format, title...) are ignored rather than refused. A schema's own "x-guidance" overrides these.
_JSON_DEFAULTS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


def closed(schema: object) -> object:
    """The schema with every object that lists its properties closed to others (additionalProperties
    false) unless it says otherwise: what OpenAI's strict mode requires and xgrammar, vLLM's default
    backend, assumes. Open, a model fills the object with keys of its own (pydantic's schemas, as
    LangChain and the openai client send them, leave it unsaid)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar text; ValueError naming the field when it is malformed."""
    import llguidance

    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed(schema)), defaults=_JSON_DEFAULTS
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=_JSON_DEFAULTS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        return llguidance.LLMatcher.grammar_from_lark(params.grammar)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs {kind}: {exc}") from None


def _tokenizer_json(hf_tokenizer) -> str:
    """The fast tokenizer's JSON as llguidance reads it. llguidance maps tokens to bytes through a byte
    level decoder only when the decoder is exactly ByteLevel; transformers' GGUF conversion (the embedded
    model's) writes a Sequence ending in ByteLevel over a ByteLevel pre-tokenizer, which it would read
    as text ("Ġyes" for " yes"). Such a tokenizer gets the plain ByteLevel decoder its tokens use."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    data = json.loads(backend.to_str())
    pre = data.get("pre_tokenizer") or {}
    decoder = data.get("decoder") or {}
    if (
        pre.get("type") == "ByteLevel"
        and decoder.get("type") == "Sequence"
        and any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []))
    ):
        data["decoder"] = {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": True,
        }
    return json.dumps(data)


def _key(params: StructuredOutputsParams) -> str:
    value = True if params.kind == "json_object" else getattr(params, params.kind)
    # Not sorted: a schema's property order is the order its output writes them in.
    return params.kind + "\0" + (value if isinstance(value, str) else json.dumps(value))


class StructuredOutputs:
    """Grammar compilation and masks for one model's tokenizer."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int) -> None:
        """load_tokenizer: returns the model's Hugging Face fast tokenizer, called on first use."""
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._ll_tokenizer = None
        self._executor = None
        # Per constraint, a matcher compiled once and never advanced: requests get copies of it.
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                hf_tokenizer = self.load_tokenizer()
                self._ll_tokenizer = llguidance.LLTokenizer(
                    _tokenizer_json(hf_tokenizer),
                    n_vocab=self.vocab_size,
                    eos_token=hf_tokenizer.eos_token_id,
                )
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def compiled(self, params: StructuredOutputsParams):
        """The constraint compiled against the tokenizer (a ValueError naming the field when llguidance
        refuses it), from the cache when seen: an unadvanced matcher."""
        import llguidance

        key = _key(params)
        matcher = self._compiled.get(key)
        if matcher is not None:
            self._compiled.move_to_end(key)
            return matcher
        try:
            matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_text(params), log_level=0)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"structured_outputs {params.kind}: {exc}") from None
        if matcher.is_error():
            raise ValueError(f"structured_outputs {params.kind}: {matcher.get_error()}")
        self._compiled[key] = matcher
        if len(self._compiled) > _CACHE_SIZE:
            self._compiled.popitem(last=False)
        return matcher

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for one request (each sequence of n > 1 gets its own): a copy of the compiled
        one, no second compilation."""
        return self.compiled(params).deep_copy()

    def fill_bitmask(self, matchers: list) -> np.ndarray:
        """One row of allowed tokens per matcher, [len(matchers), words] int32, filled in parallel by
        llguidance's threads."""
        mask = np.zeros((len(matchers), self.words), dtype=np.int32)
        if matchers:  # matchers exist only once ll_tokenizer (and the executor) were built
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], mask.ctypes.data, self.words * 4, len(matchers)
            )
        return mask


def apply_bitmask(logits, rows, bitmask) -> None:
    """logits [R, V] (torch), in place: at each of `rows`, -inf wherever its bitmask row has a 0 bit."""
    import torch

    if not len(rows):
        return
    mask = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
    bits = (mask[:, :, None] >> torch.arange(32, device=logits.device, dtype=torch.int32)) & 1
    allowed = bits.reshape(mask.shape[0], -1)[:, : logits.shape[1]].bool()
    index = torch.as_tensor(rows, device=logits.device)
    selected = logits.index_select(0, index)
    logits.index_copy_(0, index, selected.masked_fill(~allowed, float("-inf")))
