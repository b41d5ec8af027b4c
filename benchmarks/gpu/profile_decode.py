"""Where a batch-1 decode step's device time goes: torch.profiler over one request's decode, kernels
grouped by name, with the sum of kernel time per step against the step's wall time (the gap is the
device waiting for the host, or launch gaps inside the graph).
Usage: python benchmarks/gpu/profile_decode.py [--shape llama-3.1-8b] [--output-len 256] [--out FILE]
                                              [--batch 1] [--quantization fp8|int4] [--kv-cache-dtype fp8]"""

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    parser.add_argument("--quantization", default=None, help="fp8 | int4 (online)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out")
    args = parser.parse_args()
    llm = dummy_llm(
        args.shape, max_num_seqs=max(64, args.batch), quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    prompt = [[(7 * i + 13 * b) % 10000 for i in range(args.input_len)] for b in range(args.batch)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for _ in range(2):
        llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompt, sampling_params=params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    steps = args.output_len
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_us = sum(e.self_device_time_total for e in kernels)
    rows = [
        {
            "name": e.key[:90],
            "calls_per_step": e.count / steps,
            "us_per_step": e.self_device_time_total / steps,
        }
        for e in kernels
    ]
    print(f"wall {wall / steps * 1e3:.3f} ms/step, kernels {total_us / steps / 1e3:.3f} ms/step, "
          f"{sum(e.count for e in kernels) / steps:.0f} kernels/step")  # fmt: skip
    for row in rows[: args.top]:
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f}x  {row['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"wall_ms_per_step": wall / steps * 1e3, "kernels": rows}, f, indent=2)


if __name__ == "__main__":
    main()
