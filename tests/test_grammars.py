"""Constraints as users send them, compiled against the embedded SmolLM2's tokenizer (tokenmill/grammars.py):
which texts each one accepts whole and which it refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.sampling_params import StructuredOutputsParams


@pytest.fixture(scope="module")
def accepts():
    """accepts(params, text): whether the constraint takes the text, complete, token by token."""
    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    tokenizer = source.load_tokenizer()
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=1, max_families=1)

    def complete(params: StructuredOutputsParams, text: str) -> bool:
        matcher = structured.compiled(params).roots[0].deep_copy()
        ids = tokenizer.encode(text, add_special_tokens=False)
        if matcher.validate_tokens(ids) != len(ids):
            return False
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    return complete


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {}},  # LangChain's @tool without arguments
        {"properties": {}, "type": "object", "title": "ping", "description": "Ping."},
    ],
)
def test_an_object_with_no_properties_is_the_empty_object(accepts, parameters) -> None:
    """A tool without arguments (empty properties): its arguments are `{}`, not any object the model
    makes up (the embedded model wrote a whole schema as a no-argument tool's arguments)."""
    params = StructuredOutputsParams(json=parameters)
    assert accepts(params, "{}")
    assert not accepts(params, '{"city": "Rome"}')
    # Without properties at all, an object is still any object (json_object's meaning).
    assert accepts(StructuredOutputsParams(json={"type": "object"}), '{"city": "Rome"}')


# vLLM's docs' example (xgrammar's EBNF, which is GBNF), a llama.cpp-style grammar with comments, repeats,
# escapes and dashed names, and Lark as before.
SQL_GBNF = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
LIST_GBNF = r"""# a list of short words
root ::= "[" item ("," " "? item){0,2} "]" "\n"
item ::= word-or-number
word-or-number ::= [a-z]{2,5} | [0-9]+
"""


@pytest.mark.parametrize(
    ("grammar", "accepted", "refused"),
    [
        (SQL_GBNF, ["SELECT col_1  from table_2  where col_2 = 1 "], ["SELECT col_3  from table_2 "]),
        (LIST_GBNF, ["[ab, 12,xyz]\n", "[42]\n"], ["[a]\n", "[ab, cd, ef, gh]\n"]),
        ('root ::= ("yes" | "no")', ["yes", "no"], ["maybe"]),
        # llama.cpp's \u and \U escapes (a code point by 4 or 8 hex digits), in strings and classes.
        (r'root ::= "caf\u00e9 " [\u00e0-\u00ff]+ "\u4e2d\U0001F600"', ["café àÿ中😀"], ["cafe à中😀"]),
        (r'root ::= "\u0022" [\u005d\u002d]+ "\\u0041"', ['"]-]\\u0041'], ['"]-]A']),
        ('start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"', ["The answer is no."], ["no"]),
    ],
)
def test_grammars_in_gbnf_and_lark(accepts, grammar, accepted, refused) -> None:
    """vLLM's `grammar` as its users write it for xgrammar, `root ::= ...` (GBNF/EBNF), beside Lark."""
    params = StructuredOutputsParams(grammar=grammar)
    assert all(accepts(params, text) for text in accepted)
    assert not any(accepts(params, text) for text in refused)


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ('root ::= ( "a" ', "Expected ')'"),
        ("root ::= undefined-rule", "'undefined-rule' not found"),
        ('answer ::= "a"', "No 'root' rule"),
    ],
)
def test_a_malformed_grammar_is_a_value_error_naming_the_field(grammar, words) -> None:
    from tokenmill.grammars import grammar_text

    with pytest.raises(ValueError, match="structured_outputs grammar") as error:
        grammar_text(StructuredOutputsParams(grammar=grammar))
    assert words in str(error.value)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_whitespace_pattern_is_the_whitespace_json_may_hold(accepts) -> None:
    """vLLM's whitespace_pattern: JSON (json and json_object) may hold that whitespace, where it is
    otherwise compact; the compiled grammars are cached apart (the same schema, compact, first)."""
    compact, spaced = '{"a": 1}', '{ "a" : 1 }'
    assert accepts(StructuredOutputsParams(json=SCHEMA), compact)
    assert not accepts(StructuredOutputsParams(json=SCHEMA), spaced)
    for params in (
        StructuredOutputsParams(json=SCHEMA, whitespace_pattern="[ ]?"),
        StructuredOutputsParams(json_object=True, whitespace_pattern="[ ]?"),
    ):
        assert accepts(params, spaced) and accepts(params, '{"a":1}')
        assert not accepts(params, '{\n"a": 1}')
    # Compact JSON and closed objects are this server's anyway: asked for by name, nothing changes.
    params = StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True, disable_additional_properties=True
    )
    assert accepts(params, compact) and not accepts(params, spaced)
    assert not accepts(params, '{"a": 1, "b": 2}')


@pytest.mark.parametrize("pattern", [r"[\n\t ]*", r"( |\r\n)?", " {0,4}", r"\n?[ ]*"])
def test_a_whitespace_pattern_over_jsons_whitespace_is_taken(accepts, pattern) -> None:
    assert accepts(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=pattern), '{"a":1}')


@pytest.mark.parametrize("pattern", ["x", r"\s*", "(ab)?", r"[ /]?", r"\u00a0?"])
def test_a_whitespace_pattern_past_jsons_whitespace_is_refused(pattern) -> None:
    """Put between the JSON's tokens, such a pattern breaks the JSON ({x"a"x:x3x}); Unicode's \\s holds
    spaces JSON does not take."""
    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    structured = StructuredOutputs(
        resolve_model("default").load_tokenizer, 49152, mask_threads=1, max_families=1
    )
    with pytest.raises(ValueError, match="structured_outputs whitespace_pattern .* matches more than JSON's"):
        structured.compiled(StructuredOutputsParams(json=SCHEMA, whitespace_pattern=pattern))


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"regex": "[0-9]+", "whitespace_pattern": " ?"}, "shapes JSON"),
        ({"json": SCHEMA, "whitespace_pattern": " ?", "disable_any_whitespace": True}, "not both"),
        ({"json": SCHEMA, "whitespace_pattern": ""}, "non-empty regex"),
        ({"json": SCHEMA, "structural_tag": "{}"}, "exactly one of"),
    ],
)
def test_json_options_that_cannot_apply_are_value_errors(fields, words) -> None:
    with pytest.raises(ValueError, match=words):
        StructuredOutputsParams(**fields)


TAG = {
    "triggers": ["<function="],
    "structures": [
        {
            "begin": "<function=add>",
            "schema": {"type": "object", "properties": {"x": {"enum": [7]}}, "required": ["x"]},
            "end": "</function>",
        },
        {"begin": "<function=ping>", "schema": {"type": "object", "properties": {}}, "end": "</function>"},
    ],
}


@pytest.mark.parametrize("spec", [TAG, json.dumps(TAG), {"type": "structural_tag", **TAG}])
def test_a_structural_tag_constrains_what_follows_its_triggers(accepts, spec) -> None:
    """vLLM's structural tag (the form its llguidance backend reads, as a dict, its JSON text, or
    response_format's object): text is free; after a trigger, a structure: begin, JSON under its schema
    (closed, compact), end."""
    params = StructuredOutputsParams(structural_tag=spec)
    assert accepts(params, "No call needed.")
    assert accepts(params, 'Adding: <function=add>{"x": 7}</function> and <function=ping>{}</function> done')
    assert not accepts(params, 'Adding: <function=add>{"x": 8}</function>')
    assert not accepts(params, 'Adding: <function=add>{"x": 7, "y": 1}</function>')
    assert not accepts(params, "<function=sub>{}</function>")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"type": "structural_tag", "format": {"type": "triggered_tags"}}, "'format'"),
        ({**TAG, "triggers": ["<tool>"]}, "starts with none of the triggers"),
        ({**TAG, "structures": []}, "'structures' must be"),
        ({"structures": TAG["structures"]}, "'triggers' must be"),
        ("{not json", "structural_tag"),
    ],
)
def test_a_malformed_structural_tag_is_a_value_error(spec, words) -> None:
    from tokenmill.grammars import grammar_text

    with pytest.raises(ValueError, match="structured_outputs structural_tag") as error:
        grammar_text(StructuredOutputsParams(structural_tag=spec))
    assert words in str(error.value)


def test_a_regex_reads_digits_and_word_characters_as_ascii(accepts) -> None:
    r"""\d and \w as vLLM's xgrammar and outlines read them, and as JSON schema patterns do: ASCII. (Under
    Unicode's \d the embedded model wrote "🯸🯸", U+1FBF8, for \d{3}.) \s and the rest as written."""
    params = StructuredOutputsParams(regex=r"\d{3}-\w+\s[^\d]")
    assert accepts(params, "123-ab_C9 x")
    for text in ("🯸🯸🯸-ab x", "١٢٣-ab x", "123-é x", "123-ab 7"):
        assert not accepts(params, text)
    assert accepts(StructuredOutputsParams(regex="a/b|[é]"), "a/b") and accepts(
        StructuredOutputsParams(regex="é"), "é"
    )


def test_a_structural_tag_whose_triggers_are_special_tokens(accepts) -> None:
    """Triggers in <|...|> are special tokens, as Llama 3.1's <|python_tag|> (the embedded tokenizer has
    few: its <|endoftext|> stands in); one the tokenizer lacks is a ValueError naming it. Others are
    text: <tool_call>, no token of the embedded tokenizer, opens a structure all the same."""
    structure = {
        "schema": {"type": "object", "properties": {"x": {"enum": [7]}}, "required": ["x"]},
        "end": "}",
    }
    special = {"triggers": ["<|endoftext|>"], "structures": [{**structure, "begin": '<|endoftext|>{"f": '}]}
    params = StructuredOutputsParams(structural_tag=special)
    assert accepts(params, 'call: <|endoftext|>{"f": {"x": 7}}')
    assert not accepts(params, 'call: <|endoftext|>{"f": {"x": 8}}')
    missing = {"triggers": ["<|python_tag|>"], "structures": [{**structure, "begin": "<|python_tag|>"}]}
    with pytest.raises(ValueError, match="unknown special token"):
        accepts(StructuredOutputsParams(structural_tag=missing), "x")
    text = {"triggers": ["<tool_call>"], "structures": [{**structure, "begin": '<tool_call>{"f": '}]}
    assert accepts(StructuredOutputsParams(structural_tag=text), 'call: <tool_call>{"f": {"x": 7}}')
    assert not accepts(StructuredOutputsParams(structural_tag=text), 'call: <tool_call>{"f": {"x": 8}}')


def test_a_choice_of_thousands_of_labels_and_of_awkward_strings() -> None:
    """Each choice is taken whole, token by token with a mask before each (llguidance's own choice grammar
    made every choice an item of one parser row, and past 2,000 the first token failed); a prefix of one
    alone is not complete. Quotes, backslashes, newlines, non-ASCII text and the empty string are choices
    as written."""
    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    tokenizer = source.load_tokenizer()
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=1, max_families=1)
    labels = [f"label-{i}" for i in range(3000)]
    awkward = ['say "hi"', "back\\slash", "two\nlines", "ünïcode 😀", "", "tab\t", "/slashes/", "a", "ab"]
    for choices, texts, refused in ((labels, ["label-0", "label-2999"], ["label-", "label-3000"]),
                                    (awkward, awkward, ["say", "b"])):  # fmt: skip
        params = StructuredOutputsParams(choice=choices)
        for text in texts + refused:
            matcher = structured.compiled(params).roots[0].deep_copy()
            taken = True
            for token in tokenizer.encode(text, add_special_tokens=False):
                mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
                taken = taken and bool(mask[token // 8] >> (token % 8) & 1) and matcher.consume_token(token)
            matcher.compute_bitmask()
            assert not matcher.is_error(), (text, matcher.get_error())
            assert (taken and matcher.is_accepting()) == (text in texts), text


@pytest.mark.parametrize(
    "constraint",
    [{"regex": "a{300000}"}, {"json": {"type": "string", "pattern": "^b{1000000}$"}}],
)
def test_a_constraint_past_the_grammar_engines_limits_is_refused_when_compiled(constraint) -> None:
    """A repetition that builds llguidance's lexer past its limits with the first mask: that mask is whole
    and every later copy's fails, so the compile asks a second copy too, and the request is a ValueError
    (a 400) instead of a request that fails at its first token. A large repetition within them is taken."""
    from tokenmill.loader import resolve_model
    from tokenmill.structured_outputs import StructuredOutputs

    source = resolve_model("default")
    structured = StructuredOutputs(source.load_tokenizer, 49152, mask_threads=1, max_families=1)
    with pytest.raises(ValueError, match=r"too large for the grammar engine \(lexer error: too many"):
        structured.compiled(StructuredOutputsParams(**constraint))
    families = structured.compiled(StructuredOutputsParams(regex="a{20000}"))
    for _ in range(3):
        matcher = families.roots[0].deep_copy()
        matcher.compute_bitmask()
        assert not matcher.is_error()
