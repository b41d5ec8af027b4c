"""Host time to fill one step's token masks: a batch of requests under one JSON schema (the `structured`
GPU stage's array of objects), each walking its grammar by tokens drawn uniformly from what its mask
allows (what dummy weights do), with the masks filled as the engine fills them (structured_outputs.py)
for each number of families (compilations of the constraint) and mask threads, and an idle gap between
steps as the engine leaves one (the rest of its step loop). One JSON document on stdout (and --out).

    python benchmarks/grammar_masks.py [--model default | HF_DIR] [--batch 64] [--steps 128]
        [--threads 1,12] [--families 1,12] [--gaps-ms 0,5] [--schema bounded|unbounded]
        [--slices default|none|short] [--out FILE]

--schema unbounded drops the strings' maxLength; --slices sets llguidance's slicer: its defaults, none,
or its defaults with slices for strings of 1-9 characters added.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.loader import resolve_model  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402
from tokenmill.structured_outputs import MASK_THREADS, StructuredOutputs  # noqa: E402

SCHEMA = {
    "type": "array",
    "minItems": 8,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["name", "age", "role", "tags"],
    },
}


def unbounded(schema):
    """The schema without its strings' maxLength (llguidance's slicer covers unbounded strings alone)."""
    if not isinstance(schema, dict):
        return schema
    out = {key: unbounded(value) for key, value in schema.items() if key not in ("maxLength", "properties")}
    if "properties" in schema:  # names, not keywords
        out["properties"] = {name: unbounded(sub) for name, sub in schema["properties"].items()}
    return out


def slices(name: str) -> list[str] | None:
    """llguidance's slicer regexes for --slices."""
    import llguidance

    if name == "default":
        return None
    if name == "none":
        return []
    if name == "short":
        general = llguidance.LLTokenizer.general_slices()
        chars = general[1].split("{")[0]  # a JSON string's characters, as its {1,10} slice spells them
        return general[:1] + [f"{chars}{{1,{n}}}" for n in range(1, 10)] + general[1:]
    raise ValueError(f"--slices {name!r}: default, none or short")


def walk(source, vocab: int, batch: int, steps: int, threads: int, families: int, gap_s: float,
         schema: dict, slicer: list[str] | None) -> dict:  # fmt: skip
    """Mask-fill seconds per step over one random walk of `batch` requests."""
    structured = StructuredOutputs(
        source.load_tokenizer, vocab, mask_threads=threads, max_families=families, slices=slicer
    )
    constraint = StructuredOutputsParams(json=schema)
    handed = [structured.matcher(constraint) for _ in range(batch)]
    matchers, family_ids = [m for m, _ in handed], [f for _, f in handed]
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mask = structured.fill_bitmask(matchers, family_ids)
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little").reshape(batch, -1)[:, :vocab]
        for row, matcher in enumerate(matchers):
            allowed = np.flatnonzero(bits[row])
            if not matcher.is_stopped() and len(allowed):
                matcher.consume_token(int(rng.choice(allowed)))
        if gap_s:
            time.sleep(gap_s)
    return {
        "threads": threads,
        "families": families,
        "gap_ms": gap_s * 1e3,
        "mean_ms": round(statistics.fmean(times) * 1e3, 3),
        "median_ms": round(statistics.median(times) * 1e3, 3),
        "max_ms": round(max(times) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="whose tokenizer: 'default' or a model directory")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--threads", default=f"1,{MASK_THREADS}", help="comma-separated mask thread counts")
    parser.add_argument("--families", default=f"1,{MASK_THREADS}", help="comma-separated family counts")
    parser.add_argument("--gaps-ms", default="0,5", help="comma-separated idle gaps between steps")
    parser.add_argument("--schema", choices=["bounded", "unbounded"], default="bounded")
    parser.add_argument("--slices", default="default", help="llguidance's slicer: default, none or short")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    schema = SCHEMA if args.schema == "bounded" else unbounded(SCHEMA)
    slicer = slices(args.slices)
    source = resolve_model(args.model)
    vocab = source.hf_config.vocab_size
    rows = []
    for gap in (float(g) for g in args.gaps_ms.split(",")):
        for threads in (int(t) for t in args.threads.split(",")):
            for families in (int(f) for f in args.families.split(",")):
                row = walk(
                    source, vocab, args.batch, args.steps, threads, families, gap / 1e3, schema, slicer
                )
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    report = {"model": args.model, "batch": args.batch, "steps": args.steps, "default_threads": MASK_THREADS,
              "schema": args.schema, "slices": args.slices, "results": rows}  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
