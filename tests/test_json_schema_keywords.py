"""JSON Schema keywords against llguidance (tokenmill/json_schemas.py): a keyword it would ignore, so that the
output could break the schema, is a ValueError naming the keyword and where it sits; the ones it lacks but
that say what a keyword it has says (or nothing) are honoured; annotations and formats it does not know
are left alone."""

from __future__ import annotations

import pytest

from tokenmill.sampling_params import StructuredOutputsParams

BOOL = {"type": "boolean"}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
CAT = {
    "type": "object",
    "properties": {"kind": {"const": "cat"}, "lives": DIGIT},
    "required": ["kind", "lives"],
}
DOG = {
    "type": "object",
    "properties": {"kind": {"const": "dog"}, "barks": BOOL},
    "required": ["kind", "barks"],
}


@pytest.fixture(scope="module")
def structured():
    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    return StructuredOutputs(source.load_tokenizer, 49152, mask_threads=1, max_families=1)


@pytest.fixture(scope="module")
def accepts(structured):
    """accepts(schema, text): whether the schema's constraint takes the text, complete."""
    tokenizer = structured.load_tokenizer()

    def complete(schema: dict, text: str) -> bool:
        matcher = structured.compiled(StructuredOutputsParams(json=schema)).roots[0].deep_copy()
        ids = tokenizer.encode(text, add_special_tokens=False)
        return (
            matcher.validate_tokens(ids) == len(ids)
            and matcher.consume_tokens(ids)
            and matcher.is_accepting()
        )

    return complete


def tags(items: dict) -> dict:
    return {"type": "object", "properties": {"tags": {"type": "array", **items}}, "required": ["tags"]}


@pytest.mark.parametrize(
    ("schema", "refused"),
    [
        (tags({"items": DIGIT, "uniqueItems": True}), "'uniqueItems' (at #/properties/tags)"),  # set[int]
        (tags({"items": DIGIT, "contains": {"const": 7}}), "'contains' (at #/properties/tags)"),
        (
            {"type": "object", "additionalProperties": BOOL, "propertyNames": {"maxLength": 2}},
            "'propertyNames' (at #)",
        ),
        (
            {"type": "object", "properties": {"a": BOOL, "b": BOOL}, "dependentRequired": {"a": ["b"]}},
            "'dependentRequired' (at #)",
        ),
        (
            {"type": "object", "properties": {"a": BOOL}, "dependentSchemas": {"a": {"required": ["a"]}}},
            "'dependentSchemas'",
        ),
        ({"anyOf": [{"type": "string"}, {"type": "integer", "not": {"const": 3}}]}, "'not' (at #/anyOf/1)"),
        (
            {
                "type": "object",
                "properties": {"v": DIGIT},
                "if": {"required": ["v"]},
                "then": {"required": ["v"]},
            },
            "'if' (at #), 'then' (at #) are not implemented",
        ),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' (at #) is anyOf to llguidance"),
        (
            {"type": "object", "properties": {"a": BOOL, "b": BOOL, "c": BOOL}, "maxProperties": 2},
            "'maxProperties' (at #)",
        ),
        (
            {"type": "array", "allOf": [{"prefixItems": [BOOL]}], "unevaluatedItems": False},
            "'unevaluatedItems'",
        ),
        (
            {"$dynamicAnchor": "n", "type": "object", "properties": {"c": {"$dynamicRef": "#n"}}},
            "'$dynamicRef'",
        ),
    ],
)
def test_a_keyword_llguidance_would_ignore_is_refused_where_it_sits(structured, schema, refused) -> None:
    """Each of these compiled leniently, the keyword ignored: random walks of the grammar wrote [1, 1],
    [9] for contains 7, 3 under not const 3, 8 for a oneOf of integer and number."""
    with pytest.raises(ValueError, match="structured_outputs json: ") as error:
        structured.compiled(StructuredOutputsParams(json=schema))
    assert refused in str(error.value) and "the output could break the schema" in str(error.value)


INTS = {"type": "integer"}


@pytest.mark.parametrize(
    ("schema", "refused"),
    [
        ({"type": "object", "additionalProperties": INTS, "minProperties": 2}, "#"),  # dict[str, int], min 2
        ({"type": "object", "minProperties": 3}, "#"),
        (
            {"type": "object", "patternProperties": {"^x": INTS}, "minProperties": 2, "required": []},
            "#",
        ),
        (
            tags(
                {
                    "items": {
                        "type": "object",
                        "additionalProperties": INTS,
                        "minProperties": 4,
                        "properties": {"a": INTS, "b": INTS},
                        "required": ["a", "b"],
                    }
                }
            ),
            "#/properties/tags/items",
        ),  # fmt: skip
    ],
)
def test_min_properties_over_keys_that_may_repeat_is_refused(structured, accepts, schema, refused) -> None:
    """llguidance counts free keys without keeping them apart: under {additionalProperties: int,
    minProperties: 2} the embedded model wrote {"a": 9, "a": 9}, one key once parsed."""
    with pytest.raises(ValueError, match="structured_outputs json: ") as error:
        structured.compiled(StructuredOutputsParams(json=schema))
    assert f"'minProperties' (at {refused}) is counted by llguidance over keys" in str(error.value)


def test_min_properties_the_required_keys_and_one_free_key_make_up_is_honoured(accepts) -> None:
    at_least_one = {"type": "object", "additionalProperties": INTS, "minProperties": 1}
    assert accepts(at_least_one, '{"a": 1}') and not accepts(at_least_one, "{}")
    named = {
        "type": "object", "properties": {"a": INTS}, "required": ["a"], "additionalProperties": INTS,
        "minProperties": 2,
    }  # fmt: skip
    assert accepts(named, '{"a": 1, "b": 2}')
    assert not accepts(named, '{"a": 1}') and not accepts(named, '{"a": 1, "a": 2}')


def test_a_structural_tags_schema_is_refused_too(structured) -> None:
    tag = {
        "triggers": ["<f>"],
        "structures": [{"begin": "<f>", "schema": tags({"uniqueItems": True}), "end": "</f>"}],
    }
    with pytest.raises(
        ValueError, match=r"structured_outputs structural_tag: 'uniqueItems' \(at #/properties/tags\)"
    ):
        structured.compiled(StructuredOutputsParams(structural_tag=tag))


def test_pydantics_tagged_unions_through_references_are_honoured(accepts) -> None:
    """oneOf over $refs (pydantic's discriminated unions): llguidance tells the alternatives apart once it
    sees them, so they are inlined; left as references it would make the oneOf an anyOf (refused)."""
    pet = {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}
    schema = {
        "$defs": {"Cat": CAT, "Dog": DOG},
        "type": "object",
        "properties": {"pet": pet},
        "required": ["pet"],
    }
    assert accepts(schema, '{"pet": {"kind": "cat", "lives": 3}}')
    assert not accepts(schema, '{"pet": {"kind": "cat", "barks": true}}')
    tree = {
        "T": {"oneOf": [DIGIT, {"$ref": "#/$defs/L"}]},
        "L": {"type": "array", "items": {"$ref": "#/$defs/T"}},
    }
    recursive = {"$defs": tree, "$ref": "#/$defs/T"}
    assert accepts(recursive, "[1, [2, []]]")


@pytest.mark.parametrize(
    ("schema", "accepted", "refused"),
    [
        ({"type": "object", "unevaluatedProperties": False}, "{}", '{"a": 1}'),
        (
            {"type": "object", "properties": {"a": BOOL}, "unevaluatedProperties": DIGIT},
            '{"a": true, "b": 4}',
            '{"b": "x"}',
        ),
        # zod's intersection: allOf closed as a whole
        (
            {
                "allOf": [{"properties": {"a": BOOL}}, {"properties": {"b": BOOL}}],
                "unevaluatedProperties": False,
            },
            '{"a": true, "b": false}',
            '{"c": 1}',
        ),  # fmt: skip
        ({"type": "array", "prefixItems": [BOOL], "unevaluatedItems": False}, "[true]", "[true, 1]"),
        ({"type": "array", "prefixItems": [BOOL], "unevaluatedItems": DIGIT}, "[true, 1, 2]", '[true, "x"]'),
        ({"type": "array", "items": DIGIT, "uniqueItems": False}, "[1, 1]", '["x"]'),
        ({"type": "array", "items": DIGIT, "uniqueItems": True, "maxItems": 1}, "[1]", "[1, 2]"),
    ],
)
def test_keywords_llguidance_lacks_are_honoured_where_one_it_has_says_the_same(
    accepts, schema, accepted, refused
):
    assert accepts(schema, accepted)
    assert not accepts(schema, refused)


def test_annotations_and_formats_llguidance_does_not_know_are_left_alone(accepts) -> None:
    """A format asserts nothing unless a validator knows it: the string is free (jsonschema validates it)."""
    u = {"type": "string", "format": "uri-reference", "default": "x", "examples": ["y"], "deprecated": True}
    u |= {"readOnly": True, "contentMediaType": "text/plain"}
    schema = {"type": "object", "title": "T", "description": "d", "$comment": "c", "properties": {"u": u}}
    assert accepts(schema, '{"u": "any text"}')
    assert accepts({"type": "string", "format": "date"}, '"2024-02-29"')
    assert not accepts({"type": "string", "format": "date"}, '"2024-02-30"')


@pytest.mark.parametrize(
    ("schema", "refused"),
    [
        ({"type": "integer", "minimum": 1e20, "maximum": 1e20 + 5}, "'minimum' (at #)"),
        (
            tags({"items": {"type": ["integer", "null"], "exclusiveMaximum": -(2**64)}}),
            "'exclusiveMaximum' (at ",
        ),
    ],
)
def test_integer_bounds_past_64_bits_are_refused(structured, schema, refused) -> None:
    """llguidance clamps an integer's range to 64 bits: minimum 1e20 and maximum 1e20 + 5 wrote
    9223372036854775807. A bound past them on the side that keeps every output valid is honoured."""
    with pytest.raises(ValueError, match="structured_outputs json: ") as error:
        structured.compiled(StructuredOutputsParams(json=schema))
    assert f"{refused}" in str(error.value) and "past the 64-bit integers" in str(error.value)


def test_an_integer_bound_past_64_bits_that_every_output_keeps_is_honoured(accepts) -> None:
    assert accepts({"type": "integer", "maximum": 1e20}, "5")


def node(child: object, **extra: object) -> dict:
    return {"type": "object", "properties": {"child": child}, "required": ["child"], **extra}


@pytest.mark.parametrize(
    "schema",
    [
        node({"$ref": "#"}),  # requires itself
        {"$defs": {"Node": node({"$ref": "#/$defs/Node"})}, "$ref": "#/$defs/Node"},  # pydantic's form
        {  # two that require each other
            "$defs": {"A": node({"$ref": "#/$defs/B"}), "B": node({"$ref": "#/$defs/A"})},
            "$ref": "#/$defs/A",
        },
        {"type": "array", "items": {"$ref": "#"}, "minItems": 1},  # at least one item, itself
        node({"allOf": [{"$ref": "#"}]}),
        node({"anyOf": [{"$ref": "#"}, node({"$ref": "#"})]}),  # every branch requires it
    ],
)
def test_a_schema_that_requires_itself_forever_is_refused(structured, schema) -> None:
    """No finite JSON satisfies it; llguidance compiled it and masked its first tokens, and the request
    failed once the nesting passed its limits (HTTP 500)."""
    with pytest.raises(ValueError, match="structured_outputs json: no finite JSON satisfies the schema"):
        structured.compiled(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        ({"type": "object", "properties": {"child": {"$ref": "#"}}}, '{"child": {}}'),  # optional child
        (node({"anyOf": [{"$ref": "#"}, {"type": "null"}]}), '{"child": {"child": null}}'),  # Optional[Node]
        (node({"$ref": "#"}, type=["object", "null"]), '{"child": null}'),
        ({"type": "array", "items": {"$ref": "#"}}, "[[], [[]]]"),  # nested lists, none required
        (
            {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"$ref": "#"}, "minItems": 1},
            "[1]",
        ),
        (
            {
                "$defs": {"A": node({"$ref": "#/$defs/B"}), "B": {"anyOf": [{"$ref": "#/$defs/A"}, DIGIT]}},
                "$ref": "#/$defs/A",
            },
            '{"child": {"child": 3}}',
        ),  # fmt: skip
    ],
)
def test_a_recursive_schema_with_a_way_out_is_honoured(accepts, schema, text) -> None:
    assert accepts(schema, text)
