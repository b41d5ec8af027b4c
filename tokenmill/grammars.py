"""Output constraints as llguidance's grammar text: JSON schemas (closed to the keys they list, as
OpenAI's strict mode reads them), any JSON object, a regex, a choice of strings, a grammar (Lark, or
GBNF / EBNF as llama.cpp and xgrammar write it), a structural tag (free text with JSON inside tags)."""

from __future__ import annotations

import json
import re

from tokenmill.json_schemas import check_finite, check_integer_bounds, closed, one_of_refs_inlined
from tokenmill.sampling_params import StructuredOutputsParams

# JSON as OpenAI's structured outputs write it, {"a": 1, "b": [2, 3]}: no free whitespace, in which a
# small model sampling at temperature can wander until max_tokens. lenient: llguidance compiles what it
# implements and warns of the rest (json_schemas.refused_keywords() turns those warnings into errors, but
# for formats it lacks). A schema's own "x-guidance" overrides these.
_JSON_DEFAULTS = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


def json_options(params: StructuredOutputsParams) -> dict:
    """llguidance's options of the JSON a constraint writes: compact, or where it may hold whitespace,
    vLLM's whitespace_pattern (in place of the separators, which would fix it)."""
    if params.whitespace_pattern is None:
        return _JSON_DEFAULTS
    return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern, "lenient": True}


_GBNF_RULE = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=", re.MULTILINE)


# llama.cpp's GBNF escapes of a code point by 4 or 8 hex digits, after any escaped backslashes.
_GBNF_UNICODE_ESCAPE = re.compile(r"\\\\|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")


def _code_point(match: re.Match) -> str:
    """An escape llguidance's converter (1.9) would cut short (\\u00e9 -> \\ue9, another code point with
    what follows) as one it keeps: \\xHH below 256 (the characters GBNF gives a meaning to are among them),
    else the character itself."""
    digits = match.group(1) or match.group(2)
    if digits is None:  # an escaped backslash, left as it is
        return match.group(0)
    code = int(digits, 16)
    return f"\\x{code:02x}" if code < 0x100 else chr(code)


def lark(grammar: str) -> str:
    """A grammar as Lark: GBNF (llama.cpp's, which xgrammar, vLLM's default backend, reads as EBNF, so
    vLLM's users send `root ::= ...`) converted by llguidance, Lark as it is; ValueError for a GBNF
    grammar that does not parse."""
    if not _GBNF_RULE.search(grammar):
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(_GBNF_UNICODE_ESCAPE.sub(_code_point, grammar))
    except Exception as exc:  # the converter raises its own error classes
        raise ValueError(f"GBNF grammar: {exc}") from None


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar text; ValueError naming the field when it is malformed."""
    import llguidance

    kind = params.kind
    try:
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            check_integer_bounds(schema)
            check_finite(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(closed(one_of_refs_inlined(schema))), defaults=json_options(params)
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type": "object"}', defaults=json_options(params)
            )
        if kind == "structural_tag":
            return structural_tag_grammar(params.structural_tag, json_options(params))
        if kind == "regex":
            # \d and \w as ASCII, as vLLM's other backends (xgrammar, outlines) and JSON schema patterns
            # read them: under Unicode's, the embedded model wrote "🯸🯸" (U+1FBF8, a digit) for \d{3}.
            return llguidance.LLMatcher.grammar_from_lark(
                f"start: /{llguidance.regex_to_lark(params.regex, 'dw')}/"
            )
        if kind == "choice":
            # One lexeme of alternatives, not llguidance's `start: "a" | "b" ...`: there every choice is an
            # item of the parser's row, and past 2,000 of them the first token failed the request.
            options = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in params.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {options}\n")
        return llguidance.LLMatcher.grammar_from_lark(lark(params.grammar))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs {kind}: {exc}") from None


def constraint_schemas(params: StructuredOutputsParams) -> list[object]:
    """The JSON schemas a constraint holds (a json schema, a structural tag's), as the client wrote them."""
    try:
        if params.kind == "json":
            return [json.loads(params.json) if isinstance(params.json, str) else params.json]
        if params.kind == "structural_tag":
            tag = params.structural_tag
            tag = json.loads(tag) if isinstance(tag, str) else tag
            return [s.get("schema") for s in tag.get("structures", []) if isinstance(s, dict)]
    except (ValueError, AttributeError):
        pass
    return []


def structural_tag_grammar(spec: dict | str, options: dict) -> str:
    """vLLM's structural tag, in the form its llguidance backend reads: `{"structures": [{"begin",
    "schema", "end"}, ...], "triggers": [...]}` (a `"type": "structural_tag"` beside them is
    response_format's). The text is free until a trigger; a structure whose `begin` starts with it then
    follows, its JSON under `schema` (closed, written with `options`), then `end`. xgrammar's newer form
    (`"format": {...}`) is refused."""
    import llguidance

    tag = json.loads(spec) if isinstance(spec, str) else spec
    if not isinstance(tag, dict):
        raise ValueError(f"a structural tag is an object, got {tag!r}")
    if "format" in tag:
        raise ValueError(
            "the structural tag form with 'format' (xgrammar's) is not supported: give 'structures' (each "
            "{'begin', 'schema', 'end'}) and 'triggers'"
        )
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError("a structural tag's 'triggers' must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures:
        raise ValueError(
            "a structural tag's 'structures' must be a non-empty list of {'begin', 'schema', 'end'}"
        )
    tags = []
    for index, structure in enumerate(structures):
        begin = structure.get("begin") if isinstance(structure, dict) else None
        end = structure.get("end") if isinstance(structure, dict) else None
        if not isinstance(begin, str) or not isinstance(end, str):
            raise ValueError(f"structures[{index}] needs 'begin' and 'end', strings")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise ValueError(
                f"structures[{index}].begin {begin!r} starts with none of the triggers {triggers}"
            )
        schema = closed(one_of_refs_inlined(structure.get("schema") or {}))
        if not isinstance(schema, dict):
            raise ValueError(f"structures[{index}].schema must be a JSON schema (an object)")
        schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=end))
    # Triggers written as special tokens (`<|python_tag|>`, Llama 3.1's) are read as those tokens, as vLLM
    # reads every trigger in <...>; any other as text (`<tool_call>` is a token of its own in few tokenizers).
    special = all(t.startswith("<|") and t.endswith("|>") for t in triggers)
    return llguidance.StructTag.to_grammar(tags, assume_special=special)
