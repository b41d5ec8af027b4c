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
