"""Constraints as users send them, compiled against the embedded SmolLM2's tokenizer (tokenmill/grammars.py):
which texts each one accepts whole and which it refuses."""

from __future__ import annotations

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
