"""JSON schemas as tokenmill hands them to llguidance and reads its answer: closed to the keys they list
(OpenAI's strict mode), oneOf alternatives behind references inlined, keywords llguidance lacks but that
say what one it has says rewritten; then what it would leave the output free to break (its warnings,
integer bounds past 64 bits, minProperties over keys it may repeat) refused, naming where it sits."""

from __future__ import annotations

import re


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


def check_integer_bounds(schema: object) -> None:
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


def check_finite(schema: object) -> None:
    """A ValueError for a schema no finite JSON satisfies: one that holds itself through what it
    requires (a required property, an array's first items, `contains`, `allOf`, a reference) with no
    alternative that ends (another type, an `anyOf` branch, an optional property). llguidance compiles
    it and masks its first tokens, and the request failed once the nesting passed its limits. Only the
    certain cases: what could still be satisfied (or the keywords this does not read) is let through."""
    if not isinstance(schema, dict):
        return
    refs: set[str] = set()
    _collect_refs(schema, refs)
    targets = {ref: _resolve(schema, ref) if ref != "#" else schema for ref in refs}
    finite: set[str] = {ref for ref, target in targets.items() if target is None}  # not ours to judge
    grew = True
    while grew:  # the least fixed point: a reference is finite once what it names can end without it
        grew = False
        for ref, target in targets.items():
            if ref not in finite and _ends(target, finite):
                finite.add(ref)
                grew = True
    if not _ends(schema, finite):
        raise ValueError(
            "no finite JSON satisfies the schema: it requires itself (through a required property, an "
            "array's items or a reference back to it) with no alternative that ends the nesting"
        )


def _collect_refs(node: object, refs: set[str]) -> None:
    """The local references among node's subschemas (not in its const, enum or default values)."""
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            refs.add(node["$ref"])
        for _, sub in _subschemas(node):
            _collect_refs(sub, refs)


def _ends(node: object, finite: set[str]) -> bool:
    """Whether some finite JSON may satisfy node, given the references known to be satisfiable."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in finite:
        return False
    if isinstance(node.get("allOf"), list) and not all(_ends(sub, finite) for sub in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(_ends(sub, finite) for sub in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True  # literals, whatever else the node holds (not judged here)
    kinds = node.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if isinstance(kinds, str) else None
    if kinds is None or any(kind not in ("object", "array") for kind in kinds):
        return True  # a scalar type, or any type at all
    return ("object" in kinds and _object_ends(node, finite)) or (
        "array" in kinds and _array_ends(node, finite)
    )


def _object_ends(node: dict, finite: set[str]) -> bool:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return all(_ends(properties[name], finite) for name in required if name in properties)


def _array_ends(node: dict, finite: set[str]) -> bool:
    least = node.get("minItems", 0)
    least = least if isinstance(least, int) and not isinstance(least, bool) else 0
    prefix = node.get("prefixItems")
    items = node.get("items")
    if isinstance(items, list):  # draft 4-7 tuples: items as the list, additionalItems past it
        prefix, items = items, node.get("additionalItems", True)
    prefix = prefix if isinstance(prefix, list) else []
    for index in range(min(least, len(prefix) + 1)):
        if not _ends(prefix[index] if index < len(prefix) else items, finite):
            return False
    contains = node.get("contains")
    at_least = node.get("minContains", 1)
    return contains is None or at_least == 0 or _ends(contains, finite)
