"""Speculative decoding (n-gram, or layer_skip self-speculation) on the embedded SmolLM2-135M (CPU):
how many drafts are accepted on a workload that copies from its prompt (rewriting or summarising
passages of tests/data/perplexity.txt) and on free chat, and the decode speed against the same requests
without speculation, in one process. Greedy; prints one JSON document.

    python benchmarks/spec_acceptance.py [--k 4] [--max-tokens 128] [--dtype bfloat16] [--min-acceptance 0.2]
        [--method layer_skip --draft-layers 20]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.offline import speculation_stats  # noqa: E402

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"
CHAT = [
    "What are three good habits for learning a new language?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What should I pack for a weekend hiking trip?",
    "Describe a day in the life of a lighthouse keeper.",
]


def copying_prompts() -> list[str]:
    paragraphs = [p.strip() for p in TEXT.read_text().split("\n\n") if len(p.strip()) > 300]
    prompts = []
    for i, passage in enumerate(paragraphs[:6]):
        passage = passage[:700]
        if i % 2:
            prompts.append(f"Summarise this passage in a few sentences, reusing its words:\n\n{passage}")
        else:
            prompts.append(f"Rewrite this passage, keeping its wording and fixing nothing:\n\n{passage}")
    return prompts


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    outputs = llm.chat(chats, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return elapsed, sum(map(len, tokens)), tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--min-acceptance", type=float, default=0.0, help="speculative_config min_acceptance")
    parser.add_argument("--method", default="ngram", choices=("ngram", "layer_skip"))
    parser.add_argument(
        "--draft-layers", type=int, default=20, help="layer_skip: the layers that draft (of 30)"
    )
    args = parser.parse_args()
    spec = {"method": args.method, "num_speculative_tokens": args.k, "min_acceptance": args.min_acceptance}
    if args.method == "layer_skip":
        spec["draft_layers"] = args.draft_layers
    else:
        spec.update(prompt_lookup_min=1, prompt_lookup_max=4)  # the measured setting (docs/speculative.md)
    report = {"speculative_config": spec, "dtype": args.dtype, "max_tokens": args.max_tokens, "workloads": {}}
    for name, prompts in (("copying", copying_prompts()), ("chat", CHAT)):
        row = {"num_prompts": len(prompts)}
        results = {}
        for label, config in (("plain", None), ("speculative", spec)):
            llm = LLM(dtype=args.dtype, max_model_len=2048, speculative_config=config)
            run(llm, prompts[:1], 8)  # warm-up
            elapsed, count, tokens = run(llm, prompts, args.max_tokens)
            # Batched requests: time per output token of the whole batch, one request at a time below.
            single = sum(run(llm, [p], args.max_tokens)[0] for p in prompts)
            results[label] = tokens
            row[label] = {"batched_tok_s": count / elapsed, "one_at_a_time_tok_s": count / single}
            if config is not None:
                row["acceptance"] = speculation_stats(llm)
            del llm
        row["identical_outputs"] = results["plain"] == results["speculative"]
        plain, speculative = row["plain"], row["speculative"]
        row["speedup_one_at_a_time"] = speculative["one_at_a_time_tok_s"] / plain["one_at_a_time_tok_s"]
        row["speedup_batched"] = speculative["batched_tok_s"] / plain["batched_tok_s"]
        report["workloads"][name] = row
        print(json.dumps({name: row}), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
