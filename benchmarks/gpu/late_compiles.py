"""Which Triton kernel variants a request still compiles on its path after start-up warm-up: an engine on
dummy weights (each --quantization in turn) serves prompts of every length from 1 to --max-alone alone,
a sweep of longer ones up to a full step, and each length again beside a decoding request (the paged
path); every "kernel variant met after warm-up" line the engine logs is kept with the length that met it.

    python benchmarks/gpu/late_compiles.py [--shape llama-3.1-8b] [--quantizations none,fp8,int4]
        [--max-alone 300] [--out FILE]

Prints one line per late variant and writes JSON: {quantization: [{"phase", "length", "message"}]}
("length": a decode batch's size in that phase).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import dummy_llm  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402


class LateCompiles(logging.Handler):
    """Keeps the engine's late-compile warnings, each with the phase and length being served."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.where = ("start", 0)
        self.found: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "after warm-up" in message:
            phase, length = self.where
            self.found.append({"phase": phase, "length": length, "message": message[:400]})


def sweep(shape: str, quantization: str | None, max_alone: int, step_tokens: int) -> tuple[list[dict], float]:
    handler = LateCompiles()
    logger = logging.getLogger("tokenmill")
    logger.addHandler(handler)
    from triton import knobs

    # The last engine's hooks would log this one's warm-up as late: its own warm-up sets them again.
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
    start = time.perf_counter()
    llm = dummy_llm(
        shape, quantization=quantization, max_num_batched_tokens=step_tokens,
        max_model_len=step_tokens + 256, max_num_seqs=64,
    )  # fmt: skip
    started = time.perf_counter() - start
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(length)]

    def serve(phase: str, *lengths: int, max_tokens: int = 2) -> None:
        # What the phase varies: the last prompt's length, or a decode batch's size.
        handler.where = (phase, len(lengths) if phase == "decode batch" else lengths[-1])
        llm.generate(
            prompt_token_ids=[prompt(n) for n in lengths],
            sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )

    longer = sorted({*range(max_alone + 1, step_tokens + 1, 97), *range(512, step_tokens + 1, 512)})
    try:
        for length in range(1, max_alone + 1):
            serve("alone", length)
        for length in longer:
            serve("alone", length)
        for length in [*range(1, min(max_alone, 129) + 1), *longer[::4]]:  # beside a decode: the paged path
            serve("beside a decode", 40, length, max_tokens=3)
        for batch in (1, 2, 3, 5, 8, 13, 16, 17, 31, 32, 33, 48, 63, 64):  # decode batches
            serve("decode batch", *([8] * batch), max_tokens=6)
    finally:
        logger.removeHandler(handler)
    return handler.found, started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--quantizations", default="none,fp8,int4")
    parser.add_argument("--max-alone", type=int, default=300)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    results = {}
    for name in args.quantizations.split(","):
        quantization = None if name == "none" else name
        found, started = sweep(args.shape, quantization, args.max_alone, args.max_num_batched_tokens)
        results[name] = found
        gc.collect()  # the engine, gone with sweep's frame
        torch.cuda.empty_cache()
        print(f"{name}: start-up {started:.1f} s, {len(found)} late variants", flush=True)
        for item in found:
            print(f"  {item['phase']} {item['length']}: {item['message'][:240]}", flush=True)
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
