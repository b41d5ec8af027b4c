"""Where a throughput run's wall time goes: the offline workload under cProfile, top functions by
own time. Device waits show up in the call that synchronises (the sampled tokens' .tolist()).
Usage: python benchmarks/gpu/profile_engine.py [--shape qwen3-0.6b] [--num-requests 256]
                                               [--no-async-scheduling]"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import workload  # noqa: E402
from shapes import shape_dir  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    llm = LLM(
        model=shape_dir(args.shape),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        async_scheduling=args.async_scheduling,
    )
    prompts, max_tokens = workload(0, args.num_requests)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    warm = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=warm, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    steps = llm.engine.core.num_steps
    print(f"without the profiler: {sum(max_tokens) / (time.perf_counter() - start):.0f} output tok/s")
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    profiler.disable()
    seconds = time.perf_counter() - start
    print(
        f"{sum(max_tokens)} output tokens in {seconds:.2f} s under the profiler; "
        f"{llm.engine.core.num_steps - steps} engine steps; "
        f"async scheduling: {llm.engine.core.async_scheduling}"
    )
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.top)
    print(stream.getvalue())


if __name__ == "__main__":
    main()
