"""Time to compile a new (uncached) structured-output constraint: for each constraint the tests use (the
nested person schema, pydantic models as the openai client and LangChain send them, tool-call grammars
for `required` and a named function, json_object, a regex, a choice, a Lark grammar and the same as
GBNF, a schema with a whitespace pattern, a structural tag), the time from its
text to the first token mask, which is what a request with a schema the server has not seen adds to its
time to first token. The tokenizer's one-time conversion (server start-up) is timed apart. One JSON
document on stdout (and --out).

    python benchmarks/grammar_compile.py [--model default | HF_DIR] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.schemas import PERSON, TIME, WEATHER, Book, City, GetWeather  # noqa: E402
from tokenmill.entrypoints.openai.tool_calls import tool_constraint  # noqa: E402
from tokenmill.loader import resolve_model  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams as P  # noqa: E402
from tokenmill.structured_outputs import StructuredOutputs  # noqa: E402

ARITHMETIC = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,6}/
"""
# The same language as GBNF (`root ::= ...`, vLLM's users' EBNF for xgrammar), converted to Lark first.
ARITHMETIC_GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9]{1,6} | "(" expr ")"
"""


def constraints() -> dict[str, P]:
    weather = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": GetWeather.model_json_schema()},
    }
    return {
        "json_schema_person_nested": P(json=PERSON),
        "json_schema_pydantic_book": P(json=Book.model_json_schema()),
        "json_schema_pydantic_city": P(json=City.model_json_schema()),
        "tools_required_two_tools": tool_constraint([WEATHER, TIME], "required"),
        "tools_required_not_parallel": tool_constraint([WEATHER, TIME], "required", parallel=False),
        "tools_named_function": tool_constraint(
            [weather], {"type": "function", "function": {"name": "get_weather"}}
        ),
        "json_object": P(json_object=True),
        "regex_email": P(regex=r"[a-z]{1,12}@[a-z]{1,12}\.(com|org)"),
        "choice": P(choice=["positive", "negative", "neutral"]),
        "grammar_lark_arithmetic": P(grammar=ARITHMETIC),
        "grammar_gbnf_arithmetic": P(grammar=ARITHMETIC_GBNF),
        "json_schema_whitespace_pattern": P(json=PERSON, whitespace_pattern="[ \\n]{0,2}"),
        "structural_tag_weather": P(
            structural_tag={
                "structures": [
                    {
                        "begin": "<function=get_weather>",
                        "schema": GetWeather.model_json_schema(),
                        "end": "</function>",
                    }
                ],
                "triggers": ["<function="],
            }
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="whose tokenizer: 'default' or a model directory")
    parser.add_argument("--repeats", type=int, default=5, help="fresh compilations per constraint")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()

    source = resolve_model(args.model)
    vocab = source.hf_config.vocab_size
    start = time.perf_counter()
    tokenizer = source.load_tokenizer()
    load_s = time.perf_counter() - start
    base = StructuredOutputs(lambda: tokenizer, vocab)
    start = time.perf_counter()
    base.ll_tokenizer  # noqa: B018 (the tokenizer's conversion, once per server)
    setup_s = time.perf_counter() - start
    results = {}
    for name, params in constraints().items():
        times = []
        for _ in range(args.repeats):
            # An empty cache each time; the converted tokenizer is shared, as in a running server.
            structured = StructuredOutputs(lambda: tokenizer, vocab)
            structured._tokenizers, structured._executor = base._tokenizers, base._executor
            start = time.perf_counter()
            mask = structured.fill_bitmask([structured.matcher(params)[0]])
            times.append((time.perf_counter() - start) * 1e3)
            assert mask.any(), name
        row = {"first_ms": times[0], "median_ms": statistics.median(times), "max_ms": max(times)}
        results[name] = {key: round(value, 2) for key, value in row.items()}
        print(f"{name:32s} median {row['median_ms']:7.2f} ms  max {row['max_ms']:7.2f} ms", file=sys.stderr)
    report = {
        "model": args.model,
        "vocab_size": vocab,
        "tokenizer_load_s": round(load_s, 3),
        "llguidance_tokenizer_setup_s": round(setup_s, 3),
        "compile_to_first_mask_ms": results,
        "worst_median_ms": max(r["median_ms"] for r in results.values()),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
