"""Where a batch-1 decode step's device time goes: torch.profiler over one request's decode, kernels
grouped by name, with the sum of kernel time per step against the step's wall time (the gap is the
device waiting for the host, or launch gaps inside the graph). With PDL (the graphs' launches on sm_90,
kernels/pdl.py) a kernel starts before the one ahead of it ends and its time includes that wait: the
kernels can then sum past the wall time, and a short launch after a long one reads long. TOKENMILL_PDL=0
gives each kernel's own time (and a slower step).
Usage: python benchmarks/gpu/profile_decode.py [--shape llama-3.1-8b] [--output-len 256] [--out FILE]
                                              [--batch 1] [--quantization fp8|int4] [--kv-cache-dtype fp8]
                                              [--input-len 128] [--max-model-len 4096] [--decode-only]
                                              [--cached-prompts]"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import dummy_llm  # noqa: E402

from tokenmill import SamplingParams  # noqa: E402
from tokenmill.kernels import pdl  # noqa: E402


def profiled(llm, prompt, params) -> tuple[float, dict[str, tuple[float, int]]]:
    """One generate under torch.profiler: its wall seconds, and each CUDA kernel's (total us, calls)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return wall, {e.key: (e.self_device_time_total, e.count) for e in kernels}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--quantization", default=None, help="fp8 | int4 (online)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out")
    parser.add_argument(
        "--decode-only", action="store_true",
        help="subtract a profiled run of the same prompts with one output token (their prefill; prefix "
        "caching off, so both runs prefill in full)",
    )  # fmt: skip
    parser.add_argument(
        "--cached-prompts", action="store_true",
        help="with --decode-only, prefix caching on: both runs' prompts are cache hits, what is subtracted "
        "the recompute of each prompt's last block (long prompts, whose full prefill outlasts the decode)",
    )  # fmt: skip
    args = parser.parse_args()
    llm = dummy_llm(
        args.shape, max_num_seqs=max(64, args.batch), quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.cached_prompts or not args.decode_only,
        max_model_len=max(args.max_model_len, args.input_len + args.output_len),
    )  # fmt: skip
    prompt = [[(7 * i + 13 * b) % 10000 for i in range(args.input_len)] for b in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for _ in range(2):
        llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    wall, totals = profiled(llm, prompt, params)
    steps = args.output_len
    if args.decode_only:
        # The same prompts with one output token: their prefill (and its first token), taken away from
        # every kernel's total, leaves the decode steps alone.
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate(prompt_token_ids=prompt, sampling_params=one, use_tqdm=False)
        prefill_wall, prefill = profiled(llm, prompt, one)
        print(f"prefill (and first token): wall {prefill_wall * 1e3:.1f} ms, "
              f"kernels {sum(t for t, _ in prefill.values()) / 1e3:.1f} ms")  # fmt: skip
        wall -= prefill_wall
        steps -= 1
        for name, (us, count) in prefill.items():
            have_us, have_count = totals.get(name, (0.0, 0))
            totals[name] = (have_us - us, have_count - count)
    rows = [
        {"name": name[:90], "calls_per_step": count / steps, "us_per_step": us / steps}
        for name, (us, count) in sorted(totals.items(), key=lambda item: -item[1][0])
    ]
    total_us = sum(us for us, _ in totals.values())
    pdl_on = pdl._device_supports(None)  # the graphs' launches use PDL here (TOKENMILL_PDL, sm_90+)
    print(f"wall {wall / steps * 1e3:.3f} ms/step, kernels {total_us / steps / 1e3:.3f} ms/step, "
          f"{sum(count for _, count in totals.values()) / steps:.0f} kernels/step, "
          f"PDL {'on' if pdl_on else 'off'}")  # fmt: skip
    if pdl_on and total_us / 1e6 > wall:
        print("the kernels sum past the wall time: with PDL a launch's time includes its wait for the one "
              "before (TOKENMILL_PDL=0 for each kernel's own)")  # fmt: skip
    for row in rows[: args.top]:
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f}x  {row['name']}")
    if args.out:
        with open(args.out, "w") as f:
            summary = {"wall_ms_per_step": wall / steps * 1e3, "kernel_ms_per_step": total_us / steps / 1e3}
            json.dump({**summary, "pdl": pdl_on, "kernels": rows}, f, indent=2)


if __name__ == "__main__":
    main()
