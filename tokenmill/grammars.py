"""Output constraints as llguidance's grammar text: JSON schemas (closed to the keys they list, as
OpenAI's strict mode reads them), any JSON object, a regex, a choice of strings, a grammar (Lark, or
GBNF / EBNF as llama.cpp and xgrammar write it), a structural tag (free text with JSON inside tags)."""

from __future__ import annotations

import json
import re

from tokenmill.sampling_params import StructuredOutputsParams

# JSON as OpenAI's structured outputs write it, {"a": 1, "b": [2, 3]}: no free whitespace, in which a
# small model sampling at temperature can wander until max_tokens. lenient: llguidance compiles what it
# implements and warns of the rest (refused_keywords() turns those warnings into errors, but for formats it
# lacks). A schema's own "x-guidance" overrides these.
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


def closed(schema: object) -> object:
    """The schema with every object that lists its properties closed to others (additionalProperties
    false) unless it says otherwise: what OpenAI's strict mode requires and xgrammar, vLLM's default
    backend, assumes. Open, a model fills the object with keys of its own (pydantic's schemas, as
    LangChain and the openai client send them, leave it unsaid). An object made of parts (allOf, or
    properties beside anyOf / oneOf alternatives that list their own) is closed as a whole, to the
    names of all its parts: each part closed alone would forbid the others' keys. What sits under not,
    if, then and else is left as it is (closed, it would mean something else)."""
    if not isinstance(schema, dict):
        return schema
    return _Closer(schema).close(schema)


class _Closer:
    def __init__(self, root: dict) -> None:
        self.root = root
        # Local references used as parts of a larger object: the definitions they name are left open.
        self.parts: set[str] = set()
        self._find_parts(root)

    def _find_parts(self, node: object) -> None:
        if isinstance(node, list):
            for value in node:
                self._find_parts(value)
        if not isinstance(node, dict):
            return
        keys = ["allOf"] + (["anyOf", "oneOf"] if isinstance(node.get("properties"), dict) else [])
        for key in keys:
            for branch in node.get(key) if isinstance(node.get(key), list) else []:
                if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                    self.parts.add(branch["$ref"])
        for value in node.values():
            self._find_parts(value)

    def names(self, branch: object) -> set[str]:
        """The property names a part lists (through one local reference)."""
        if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
            branch = _resolve(self.root, branch["$ref"])
        properties = branch.get("properties") if isinstance(branch, dict) else None
        return set(properties) if isinstance(properties, dict) else set()

    def close(self, schema: object, part: bool = False, beside: frozenset[str] = frozenset()) -> object:
        """part: an allOf part (left open itself); beside: the names of the properties next to this
        anyOf / oneOf alternative, which it holds too."""
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        _as_implemented(out)
        for key in ("properties", "patternProperties", "dependentSchemas"):
            if isinstance(out.get(key), dict):
                out[key] = {name: self.close(sub) for name, sub in out[key].items()}
        for key in ("$defs", "definitions"):
            if isinstance(out.get(key), dict):
                out[key] = {
                    name: self.close(sub, part=f"#/{key}/{name}" in self.parts)
                    for name, sub in out[key].items()
                }
        own = self.names(out) if "$ref" not in out else set()
        names = set(own)
        if isinstance(out.get("allOf"), list):
            out["allOf"] = [self.close(sub, part=True) for sub in out["allOf"]]
            names.update(*map(self.names, out["allOf"]))
        for key in ("anyOf", "oneOf"):
            if isinstance(out.get(key), list):
                out[key] = [self.close(sub, beside=frozenset(own)) for sub in out[key]]
                if own:
                    names.update(*map(self.names, out[key]))
        if isinstance(out.get("prefixItems"), list):
            out["prefixItems"] = [self.close(sub) for sub in out["prefixItems"]]
        for key in ("items", "additionalProperties", "contains"):
            if isinstance(out.get(key), dict):
                out[key] = self.close(out[key])
        if own and beside:
            names |= beside
        # An empty `properties` lists no names but says the object has none (a tool without arguments,
        # as LangChain and pydantic write one): closed, it is `{}`; open, a model fills it with anything.
        no_properties = out.get("properties") == {} and not beside
        no_properties = no_properties and not any(key in out for key in ("allOf", "anyOf", "oneOf"))
        lists_properties = bool(names) or no_properties
        if lists_properties and not part and "additionalProperties" not in out:
            properties = dict(out.get("properties") or {})
            out["properties"] = {**properties, **{name: {} for name in sorted(names - set(properties))}}
            out["additionalProperties"] = False
        if "additionalProperties" in out:  # it takes every property that is left: none is unevaluated
            out.pop("unevaluatedProperties", None)
        return out


# Keywords whose subschemas apply to the instance itself, so that unevaluatedProperties / unevaluatedItems
# reach past the node's own properties and items.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else", "dependentSchemas")


def _as_implemented(node: dict) -> None:
    """Keywords llguidance does not implement, in place, where they say nothing (uniqueItems false, or
    over at most one item) or what one it implements says: unevaluatedProperties / unevaluatedItems on a
    node with nothing applied in place are additionalProperties / items (additionalItems after a draft 7
    tuple), and no-ops beside those. Any other use is left for refused_keywords() to refuse."""
    max_items = node.get("maxItems")
    if node.get("uniqueItems") is False or (isinstance(max_items, int) and max_items <= 1):
        node.pop("uniqueItems", None)
    if any(key in node for key in _IN_PLACE):
        return
    if "unevaluatedProperties" in node:
        unevaluated = node.pop("unevaluatedProperties")
        node.setdefault("additionalProperties", unevaluated)
    if "unevaluatedItems" in node:
        unevaluated = node.pop("unevaluatedItems")
        node.setdefault("additionalItems" if isinstance(node.get("items"), list) else "items", unevaluated)


def _resolve(root: dict, ref: str) -> object:
    """What a local JSON pointer ("#/$defs/Name") names in the root schema, else None."""
    if not ref.startswith("#/"):
        return None
    node: object = root
    for part in ref[2:].split("/"):
        if not isinstance(node, dict):
            return None
        node = node.get(part.replace("~1", "/").replace("~0", "~"))
    return node


# Where a schema holds subschemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_ONES = (
    "items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
    "contains", "propertyNames", "not", "if", "then", "else", "contentSchema",
)  # fmt: skip
_ANNOTATIONS = {
    "title", "description", "$comment", "examples", "default", "deprecated", "readOnly", "writeOnly",
}  # fmt: skip


def _subschemas(node: dict) -> list[tuple[str, object]]:
    """(JSON pointer step, subschema) for each subschema a schema holds."""
    found: list[tuple[str, object]] = []
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            found += [(f"{key}/{name}", sub) for name, sub in node[key].items()]
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            found += [(f"{key}/{index}", sub) for index, sub in enumerate(node[key])]
    return found + [(key, node[key]) for key in _SCHEMA_ONES if isinstance(node.get(key), dict)]


def one_of_refs_inlined(schema: object) -> object:
    """The schema with each oneOf alternative that is a local reference replaced by what it names (once
    per reference along a path, so recursive ones stop): llguidance proves alternatives disjoint (the
    consts of a discriminator, as pydantic's tagged unions have) only when it sees them, and otherwise
    makes oneOf an anyOf, under which an output may match two (refused_keywords() refuses that)."""
    if not isinstance(schema, dict):
        return schema
    root = schema

    def inline(node: object, seen: frozenset[str]) -> object:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: inline(sub, seen) for name, sub in out[key].items()}
        for key in _SCHEMA_LISTS:
            if isinstance(out.get(key), list):
                out[key] = [inline(sub, seen) for sub in out[key]]
        for key in _SCHEMA_ONES:
            if isinstance(out.get(key), dict):
                out[key] = inline(out[key], seen)
        if isinstance(out.get("oneOf"), list):
            out["oneOf"] = [alternative(branch, seen) for branch in out["oneOf"]]
        return out

    def alternative(branch: object, seen: frozenset[str]) -> object:
        ref = branch.get("$ref") if isinstance(branch, dict) else None
        if not isinstance(ref, str) or ref in seen or not set(branch) - {"$ref"} <= _ANNOTATIONS:
            return branch
        target = _resolve(root, ref)
        if not isinstance(target, dict):
            return branch
        annotations = {key: value for key, value in branch.items() if key != "$ref"}
        return inline({**target, **annotations}, seen | {ref})

    return inline(schema, frozenset())


# A GBNF rule definition, `root ::= ...` (Lark writes `start: ...`).
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
            _check_integer_bounds(schema)
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
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        return llguidance.LLMatcher.grammar_from_lark(lark(params.grammar))
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"structured_outputs {kind}: {exc}") from None


# What llguidance warns of when it compiles a schema leniently, and what each means for the output: a
# keyword it ignores (the output may break it), oneOf made anyOf (an output may match two alternatives),
# min/maxProperties over optional properties ignored. A format it lacks leaves the string free, which
# every validator takes (a format it does not know asserts nothing): the one warning let through.
_UNIMPLEMENTED = re.compile(r"^Unimplemented keys: \[(.*?)\]")
_ONE_OF = "oneOf not fully supported"
_PROPERTY_COUNTS = "min/maxProperties only supported"
_HARMLESS = "Unknown format: "


def refused_keywords(warnings: list[str], schemas: list[object]) -> str | None:
    """Why a constraint is refused, from llguidance's warnings on compiling it (None: nothing the output
    could break): the schema keywords it would ignore, each where `schemas` (the constraint's JSON schemas)
    hold it, as JSON pointers ("#/properties/tags")."""
    reasons: dict[str, str] = {}  # keyword -> why, to follow "is" / "are"
    for warning in warnings:
        if warning.startswith(_HARMLESS):
            continue
        unimplemented = _UNIMPLEMENTED.match(warning)
        if unimplemented:
            for name in re.findall(r'"([^"]+)"', unimplemented.group(1)):
                reasons.setdefault(name, "not implemented by llguidance")
        elif warning.startswith(_ONE_OF):
            reasons["oneOf"] = (
                "anyOf to llguidance, which cannot tell its alternatives apart (use anyOf, or alternatives "
                "that differ in a required const)"
            )
        elif warning.startswith(_PROPERTY_COUNTS):
            for name in ("minProperties", "maxProperties"):
                reasons[name] = "enforced by llguidance only when every listed property is required"
        else:
            reasons[warning] = ""
    where = {name: _where(schemas, name) for name in reasons}
    if any(where.values()):  # one warning names both min/maxProperties: the schema says which it holds
        reasons = {name: reason for name, reason in reasons.items() if where[name] or not reason}
    repeatable = _where(schemas, "minProperties", test=_min_properties_over_repeatable_keys)
    if repeatable and "minProperties" not in reasons:
        reasons["minProperties"] = (
            "counted by llguidance over keys it does not keep apart (one free key written twice counts "
            "twice, and parses as one): name the properties and require them, or ask for at most one more "
            "than the required ones"
        )
        where["minProperties"] = repeatable
    if not reasons:
        return None
    by_reason: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        at = f" (at {', '.join(where[name])})" if where[name] else ""
        by_reason.setdefault(reason, []).append(f"'{name}'{at}")
    parts = [
        f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} {reason}"
        if reason
        else f"llguidance: {names[0]}"
        for reason, names in by_reason.items()
    ]
    them = "it" if len(reasons) == 1 else "them"
    return (
        f"{'; '.join(parts)}; the output could break the schema, so it is refused: remove or rewrite {them}"
    )


_INT64 = (-(2**63), 2**63 - 1)


def _check_integer_bounds(schema: object) -> None:
    """A ValueError for an integer's bound past the 64-bit integers llguidance's ranges hold: it clamps
    them, so that minimum 1e20 with maximum 1e20 + 5 wrote 9223372036854775807."""

    def past(keyword: str, node: dict) -> bool:
        kinds = node.get("type")
        value = node.get(keyword)
        if "integer" not in (kinds if isinstance(kinds, list) else [kinds]) or isinstance(value, bool):
            return False
        if not isinstance(value, (int, float)):
            return False
        return value > _INT64[1] if keyword in ("minimum", "exclusiveMinimum") else value < _INT64[0]

    for keyword in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        found = _where([schema], keyword, test=lambda node, keyword=keyword: past(keyword, node))
        if found:
            raise ValueError(
                f"'{keyword}' (at {', '.join(found)}) is past the 64-bit integers (-2**63 to 2**63 - 1) that "
                "llguidance's integer ranges hold"
            )


def _min_properties_over_repeatable_keys(node: dict) -> bool:
    """An object whose minProperties its required properties and one free key do not make up. Its free
    keys (additionalProperties, patternProperties; an object that lists no properties stays open) may
    repeat one another in llguidance's grammar, so only the required names and one free key are sure to
    be distinct keys of the parsed object."""
    count, required = node.get("minProperties"), node.get("required")
    names = set(required) if isinstance(required, list) else set()
    extra = node.get("additionalProperties")
    free = bool(node.get("patternProperties")) or (
        extra is not False and (extra is not None or not isinstance(node.get("properties"), dict))
    )
    return free and isinstance(count, int) and count > len(names) + 1


def _where(schemas: list[object], keyword: str, limit: int = 3, test=None) -> list[str]:
    """JSON pointers to the subschemas of `schemas` that hold `keyword` (at most `limit`), those that also
    pass `test` where one is given."""
    found: list[str] = []

    def visit(node: object, pointer: str) -> None:
        if not isinstance(node, dict) or len(found) >= limit:
            return
        if keyword in node and (test is None or test(node)):
            found.append(f"#{pointer}")
        for step, sub in _subschemas(node):
            visit(sub, f"{pointer}/{step}")

    for schema in schemas:
        visit(schema, "")
    return found


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
