"""The output constraint of a chat or completions body, read as vLLM's server reads it: OpenAI's
response_format, vLLM's structured_outputs object, or the older guided_* fields, one of them, each a 400
naming its field when malformed."""

from __future__ import annotations

import json

from tokenmill.sampling_params import StructuredOutputsParams

from .errors import ParamError

# What vLLM's structured_outputs object may hold: one constraint and the options of its JSON.
STRUCTURED_OUTPUTS_KEYS = {
    "json", "json_object", "regex", "choice", "grammar", "structural_tag",
    "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties",
}  # fmt: skip
# vLLM's StructuredOutputsParams fields that choose among its backends, not what the output may be: a
# client sending the dataclass whole (dataclasses.asdict) sends them too, and vLLM's server takes them.
BACKEND_KEYS = {"_backend", "_backend_was_auto", "disable_fallback"}
GUIDED_KINDS = ("json", "regex", "choice", "grammar")


def given_constraints(
    response_format: dict | None, structured_outputs: dict | None, guided: dict[str, object]
) -> list[tuple[str, dict]]:
    """(request field, StructuredOutputsParams fields) for every constraint the request gives: OpenAI's
    response_format (json_object, json_schema with its schema, or vLLM's structural_tag; completions take
    it too, as vLLM's do) beside vLLM's fields. guided: guided_json ... guided_grammar by kind."""
    found = []
    if response_format is not None and "type" not in response_format:  # OpenAI's and vLLM's 400 too
        raise ParamError("response_format", "response_format needs its type ('text', 'json_object', ...)")
    kind = response_format["type"] if response_format is not None else "text"
    if kind == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif kind == "json_schema":
        spec = response_format.get("json_schema")  # type: ignore[union-attr]
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ParamError(
                "response_format", "response_format json_schema needs json_schema.schema, an object"
            )
        name = spec.get("name")  # type: ignore[union-attr]
        if not isinstance(name, str) or not name:
            raise ParamError(
                "response_format", "response_format json_schema needs json_schema.name, the schema's name"
            )
        found.append(("response_format", {"json": schema}))
    elif kind == "structural_tag":  # vLLM's: the tag itself, beside its type
        found.append(("response_format", {"structural_tag": response_format}))
    elif kind != "text":
        raise ParamError(
            "response_format",
            "response_format type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
            f"got {kind!r}",
        )
    if structured_outputs is not None:
        found.append(("structured_outputs", dict(structured_outputs)))
    found += [(f"guided_{kind}", {kind: value}) for kind, value in guided.items() if value is not None]
    return found


def one_constraint(
    found: list[tuple[str, dict]], guided_whitespace_pattern: str | None
) -> tuple[str, StructuredOutputsParams] | None:
    """The request's one constraint and the field it came from; ParamError for two or a bad one.
    guided_whitespace_pattern: vLLM's older field for the whitespace_pattern of the guided_* JSON."""
    if not found:
        if guided_whitespace_pattern is not None:
            raise ParamError(
                "guided_whitespace_pattern", "guided_whitespace_pattern shapes the JSON of guided_json"
            )
        return None
    if len(found) > 1:
        raise ParamError(found[1][0], f"give one output constraint, got {', '.join(f for f, _ in found)}")
    field_name, fields = found[0]
    # A null is the default, as for the request's own fields (a client sending vLLM's dataclass whole,
    # whose backend fields say nothing here).
    fields = {key: value for key, value in fields.items() if value is not None and key not in BACKEND_KEYS}
    unknown = sorted(set(fields) - STRUCTURED_OUTPUTS_KEYS)
    if unknown:
        raise ParamError(field_name, f"unknown key(s) {unknown}; known: {sorted(STRUCTURED_OUTPUTS_KEYS)}")
    if guided_whitespace_pattern is not None:
        fields = {**fields, "whitespace_pattern": guided_whitespace_pattern}
    fields = {
        key: as_text(value) if key in ("json", "structural_tag") else value for key, value in fields.items()
    }
    try:
        return field_name, StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise ParamError(field_name, str(exc)) from None


def as_text(value: object) -> object:
    """A schema (or structural tag) as its JSON text, the form it crosses to the engine core in: msgpack
    carries no integer past 64 bits, which a schema may hold (`"maximum": 10**30`), and the text is what
    llguidance compiles anyway (property order kept)."""
    return json.dumps(value) if isinstance(value, dict) else value
