"""The skinny GEMM against cuBLAS (F.linear) on the linears of a decode step, bf16, weight-read bandwidth.

Sweeps the kernel's tile configs at one row over the Llama-3.1-8B linears, then runs the best single
config and cuBLAS at 1, 4, 8 and 16 rows. Each time is the median of CUDA-graph replays of 20 calls.
Usage: python benchmarks/gpu/bench_skinny_gemm.py [--out FILE]"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

import torch
import torch.nn.functional as F

from tokenmill.kernels.skinny_gemm import SkinnyConfig, skinny_gemm

# (name, N, K): Llama-3.1-8B's linears (QKV, O, gate+up, down, LM head) and Qwen3-0.6B's QKV and down.
SHAPES = [
    ("8b.qkv", 6144, 4096),
    ("8b.o", 4096, 4096),
    ("8b.gate_up", 28672, 4096),
    ("8b.down", 4096, 14336),
    ("8b.lm_head", 128256, 4096),
    ("0.6b.qkv", 4096, 1024),
    ("0.6b.down", 1024, 3072),
]
EIGHT_B = [s for s in SHAPES if s[0].startswith("8b")]


def graph_time(fn, calls: int = 20, repeats: int = 15) -> float:
    """Seconds per call: `calls` calls captured in one CUDA graph, median over replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for name, n, k in SHAPES}
    xs = {(name, m): torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for name, _, k in SHAPES
          for m in (1, 4, 8, 16)}  # fmt: skip

    def bandwidth(name: str, seconds: float) -> float:
        return weights[name].numel() * 2 / seconds

    configs = [
        SkinnyConfig(bn, bk, warps, stages)
        for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5))
    ]
    sweep = {}
    for config in configs:
        row = {}
        for name, _, _ in EIGHT_B:
            w, x = weights[name], xs[(name, 1)]
            try:
                row[name] = bandwidth(name, graph_time(lambda x=x, w=w, c=config: skinny_gemm(x, w, c)))
            except Exception as exc:  # a config that does not compile (shared memory) is skipped
                row[name] = None
                print(f"{config}: {type(exc).__name__}")
                break
        if all(v is not None for v in row.values()):
            sweep[str(tuple(config))] = row
            gm = math.exp(statistics.mean(math.log(v) for v in row.values()))
            print(f"{tuple(config)}: geomean {gm / 1e12:.2f} TB/s", flush=True)
    best_key = max(sweep, key=lambda key: sum(math.log(v) for v in sweep[key].values()))
    best = SkinnyConfig(*eval(best_key))
    print(f"best single config: {best}")
    compare = {}
    for name, _, _ in SHAPES:
        w = weights[name]
        for m in (1, 4, 8, 16):
            x = xs[(name, m)]
            ours = graph_time(lambda x=x, w=w: skinny_gemm(x, w, best))
            cublas = graph_time(lambda x=x, w=w: F.linear(x, w))
            torch.testing.assert_close(skinny_gemm(x, w, best), F.linear(x, w), atol=0.05, rtol=0.02)
            compare[f"{name}.m{m}"] = {
                "ours_us": ours * 1e6,
                "cublas_us": cublas * 1e6,
                "ours_TBps": bandwidth(name, ours) / 1e12,
                "cublas_TBps": bandwidth(name, cublas) / 1e12,
                "speedup": cublas / ours,
            }
            c = compare[f"{name}.m{m}"]
            print(
                f"{name:12s} m={m:2d}  ours {c['ours_us']:8.1f} us {c['ours_TBps']:.2f} TB/s  "
                f"cuBLAS {c['cublas_us']:8.1f} us {c['cublas_TBps']:.2f} TB/s  x{c['speedup']:.2f}"
            )
    result = {"device": torch.cuda.get_device_name(), "best": best_key, "sweep": sweep, "compare": compare}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
