"""What a step costs when new prompts join a full decode batch (issue 10's inter-token tail): 252
requests decode, then 4 new 512-token prompts arrive each few steps, as in the 256-stream serving
workload. Prints the wall time of decode-only and mixed steps and, under torch.profiler, the device
time per kernel in the mixed steps, so host time and device time can be told apart.
Usage: python benchmarks/gpu/profile_mixed_step.py [--shape qwen3-0.6b] [--new-per-wave 4]
       [--waves 8] [--engine-json '{"max_prefill_tokens_with_decodes": 2048}'] [--out FILE]"""

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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(engine, count: int) -> list[float]:
    """Wall time between successive step() returns (each returns one finished step's outputs)."""
    times = []
    last = time.perf_counter()
    for _ in range(count):
        engine.step()
        now = time.perf_counter()
        times.append((now - last) * 1e3)
        last = now
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--running", type=int, default=252)
    parser.add_argument("--new-per-wave", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--waves", type=int, default=8)
    parser.add_argument("--steps-per-wave", type=int, default=4)
    parser.add_argument("--engine-json", default="{}", help="more LLM(...) options, as JSON")
    parser.add_argument("--config-overrides", default="{}", help="config.json overrides, as JSON")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    # Room for every request ever added (they never finish): the warm-up's waves and the profiled ones.
    options = dict(
        max_num_seqs=args.running + 2 * args.new_per_wave * args.waves, max_num_batched_tokens=8192
    )
    llm = dummy_llm(
        args.shape, json.loads(args.config_overrides), **{**options, **json.loads(args.engine_json)}
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    counter = iter(range(10**9))

    def add(count: int) -> None:
        for _ in range(count):
            i = next(counter)
            engine.add_request(f"r{i}", [(i * 7 + j) % 10000 for j in range(args.input_len)], params)

    add(args.running)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    timed_steps(engine, 20)  # settle (and replay every graph size once)
    sync()
    decode = timed_steps(engine, 30)

    def waves() -> list[float]:
        mixed = []
        for _ in range(args.waves):
            add(args.new_per_wave)
            mixed += timed_steps(engine, args.steps_per_wave)
        assert not engine.scheduler.num_waiting, "new requests were left waiting: raise max_num_seqs"
        return mixed

    waves()  # warm-up: first encounters of the mixed shapes
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=activities) as prof:
        mixed = waves()
        sync()
    steps = args.waves * args.steps_per_wave
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    device_ms = sum(e.self_device_time_total for e in events) / 1e3
    result = {
        "shape": args.shape,
        "running": args.running,
        "new_per_wave": args.new_per_wave,
        "input_len": args.input_len,
        "engine": json.loads(args.engine_json),
        "decode_step_ms": sorted(decode)[len(decode) // 2],
        "mixed_step_ms": [round(t, 2) for t in mixed],
        "prompt_tokens_per_wave": args.new_per_wave * args.input_len,
        "mixed_wall_ms_per_step": sum(mixed) / steps,
        "mixed_device_ms_per_step": device_ms / steps,
        "kernels": [
            {
                "name": e.key[:90],
                "calls_per_step": e.count / steps,
                "us_per_step": e.self_device_time_total / steps,
            }
            for e in events[: args.top]
        ],
    }
    print(f"decode-only step {result['decode_step_ms']:.2f} ms (median of 30)")
    print(f"mixed steps: wall {result['mixed_wall_ms_per_step']:.2f} ms/step, device "
          f"{result['mixed_device_ms_per_step']:.2f} ms/step; each: {result['mixed_step_ms']}")  # fmt: skip
    for row in result["kernels"]:
        print(f"{row['us_per_step']:9.1f} us  {row['calls_per_step']:6.1f}x  {row['name']}")
    cpu = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    print("host (self CPU time per step):")
    for e in cpu:
        print(f"{e.self_cpu_time_total / steps / 1e3:9.3f} ms  {e.count / steps:6.1f}x  {e.key[:80]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
