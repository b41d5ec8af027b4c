"""The decode step of engine variants in one process, timed in turns: the A/B behind a switch's default
where the effect is a percent or two and a step's time moves more than that between processes (an H100's
32k FP8 step read 17.63 and 18.05 ms in two processes a minute apart, fiftieth session). Each variant is
an engine of its own on the same dummy weights' shape (gpu_memory_utilization split between them), its
CUDA graphs captured with its knobs set; the knobs are module switches read at launch, so a graph keeps
what it captured, and each variant's knobs are set again before its runs for any eager launch:
  tiles=W,A[,B]   kernels/fp8_decode_cuda.py CONFIG (the CUDA FP8 decode's warps, tiles ahead, blocks)
  merge=0|1       kernels/fp8_decode_cuda.py MERGE_IN_KERNEL (the splits merged in the decode's launch)
  tmerge=0|1      kernels/attention.py MERGE_IN_KERNEL (the same in the Triton decode's launch: a bf16 cache)
  rotary=0|1      layers/attention.py DECODE_ROTARY (the step's rotary and K/V store in attention's launch)
  block=N         the engine's block_size (tokens a KV-cache page; 16 unless set), at its construction
Each round times every variant once (the prompts' one-token run, then the full decode, both over cached
prompts; the step is their difference over the new tokens), the order reversed every other round; the
figures are each variant's median step and its median ratio to the first variant within a round.

    python benchmarks/gpu/ab_decode_step.py --variants base: ahead2:tiles=2,2 [merge:merge=1+tiles=2,2]
        [--shape llama-3.1-8b] [--batch 16] [--input-len 32768] [--output-len 64] [--kv-cache-dtype fp8]
        [--rounds 6] [--out FILE]
(Two variants of the 8B at 16 x 32k with an FP8 cache fit an H200: each holds 16 GB of weights and needs
~34 GB of cache; a variant whose cache cannot hold the batch whole is refused.)"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import dummy_llm, timed_generate  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.kernels import attention as attention_kernels  # noqa: E402
from tokenmill.kernels import fp8_decode_cuda  # noqa: E402
from tokenmill.layers import attention  # noqa: E402


def _tiles(value: str) -> None:
    fp8_decode_cuda.CONFIG = fp8_decode_cuda.parse_tiles(value, "tiles")


KNOBS = {
    "tiles": _tiles,
    "merge": lambda v: setattr(fp8_decode_cuda, "MERGE_IN_KERNEL", v == "1"),
    "rotary": lambda v: setattr(attention, "DECODE_ROTARY", v == "1"),
    "tmerge": lambda v: setattr(attention_kernels, "MERGE_IN_KERNEL", v == "1"),
}
DEFAULTS = (
    fp8_decode_cuda.CONFIG, fp8_decode_cuda.MERGE_IN_KERNEL, attention.DECODE_ROTARY,
    attention_kernels.MERGE_IN_KERNEL,
)  # fmt: skip
# Knobs that are the engine's options, set when it is built: knob -> LLM keyword.
ENGINE_KNOBS = {"block": "block_size"}


def parse_variant(text: str) -> tuple[str, list[tuple[str, str]]]:
    """'name:knob=value+knob=value' -> (name, [(knob, value), ...]); 'name:' is the defaults."""
    name, _, spec = text.partition(":")
    knobs = [tuple(item.split("=", 1)) for item in spec.split("+") if item]
    names = [*KNOBS, *ENGINE_KNOBS]
    for knob in knobs:
        if len(knob) != 2 or knob[0] not in names:
            raise ValueError(f"variant {text!r}: knobs are {', '.join(names)} as knob=value, joined by '+'")
    return name, knobs  # type: ignore[return-value]


def apply(knobs: list[tuple[str, str]]) -> None:
    (
        fp8_decode_cuda.CONFIG, fp8_decode_cuda.MERGE_IN_KERNEL, attention.DECODE_ROTARY,
        attention_kernels.MERGE_IN_KERNEL,
    ) = DEFAULTS  # fmt: skip
    for knob, value in knobs:
        if knob in KNOBS:
            KNOBS[knob](value)


def engine_options(knobs: list[tuple[str, str]]) -> dict:
    return {ENGINE_KNOBS[knob]: int(value) for knob, value in knobs if knob in ENGINE_KNOBS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", required=True, help="name:knob=value+knob=value")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=32768)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(args.input_len)] for _ in range(args.batch)]
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    full = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    engines = {}
    for name, knobs in variants:
        apply(knobs)
        options = engine_options(knobs)
        llm = dummy_llm(
            args.shape, max_model_len=args.input_len + args.output_len + 256, max_num_seqs=args.batch,
            kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
            gpu_memory_utilization=0.9 / len(variants), **options,
        )  # fmt: skip
        need_blocks = args.batch * -(-(args.input_len + args.output_len) // options.get("block_size", 16))
        have_blocks = llm.engine.scheduler.kv.num_blocks
        if have_blocks < need_blocks:
            raise SystemExit(f"variant {name}: {have_blocks} KV blocks hold less than the batch's "
                             f"{need_blocks}: fewer variants, or a shorter context")  # fmt: skip
        timed_generate(llm, prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        engines[name] = (llm, knobs)
    steps: dict[str, list[float]] = {name: [] for name, _ in variants}
    for round_ in range(args.rounds):
        order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
        for name in order:
            llm, knobs = engines[name]
            apply(knobs)
            ttft = timed_generate(llm, prompts, first)
            total = timed_generate(llm, prompts, full)
            steps[name].append((total - ttft) / (args.output_len - 1) * 1e3)
        print(f"round {round_}: " + ", ".join(f"{n} {steps[n][-1]:.3f} ms" for n in engines), flush=True)
    base = variants[0][0]
    summary = {
        name: {
            "knobs": dict(knobs),
            "step_ms_median": statistics.median(steps[name]),
            "step_ms": steps[name],
            "ratio_to_first_median": statistics.median(s / b for s, b in zip(steps[name], steps[base])),
        }
        for name, knobs in variants
    }
    for name, row in summary.items():
        print(f"{name}: {row['step_ms_median']:.3f} ms a step (median of {args.rounds}), "
              f"{row['ratio_to_first_median']:.4f}x {base}'s time")  # fmt: skip
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": device, "args": vars(args), "variants": summary}, f, indent=1)


if __name__ == "__main__":
    main()
