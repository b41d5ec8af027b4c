"""The one-row GEMVs of batch-1 decode, one launch each inside the CUDA profiler's range, for Nsight
Compute: where each kernel's time goes (memory throughput, warp stalls, occupancy) on the card at hand.
Llama-3.1-8B's four linears, bf16 (dense_gemv), FP8 (the W8A16 one-row kernel), INT4 (the packed-fp16
Triton kernel and the CUDA tensor-core GEMV), each at the engine's tiles; every kernel runs once before
the range, so that none is compiled inside it.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats python3 benchmarks/gpu/gemv_ncu.py [--kinds bf16,fp8,...]

(`run_all.sh ncu-gemv` runs it so and writes the report under OUTDIR.) The launch order, one line per
launch, is printed first: Nsight Compute names the kernels, not the shapes.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant_gemm import GROUP, SHAPES, int4_weights  # noqa: E402

from tokenmill.kernels import skinny_gemm, w4a16_gemv_cuda  # noqa: E402

KINDS = ("bf16", "fp8", "int4-triton", "int4-cuda")


def launches(kind: str, n: int, k: int, gen: torch.Generator):
    """A function that launches `kind`'s one-row GEMV over a random [n, k] weight."""
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    if kind == "bf16":
        w = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
        return lambda: skinny_gemm.dense_gemv(x, w)
    if kind == "fp8":
        w = (torch.randn(n, k, device="cuda", generator=gen) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda", generator=gen) * 0.01
        return lambda: skinny_gemm.w8a16_skinny(x, w, scale)
    packed, scale = int4_weights(n, k, gen)[2][0]  # the first of bench_quant_gemm's copies
    if kind == "int4-triton":
        return lambda: skinny_gemm.w4a16_skinny(x, packed, scale, None, GROUP)
    return lambda: w4a16_gemv_cuda.w4a16_gemv_mma(x, packed, scale, None, GROUP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    runs = []
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            raise ValueError(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            launch = launches(kind, n, k, gen)
            launch()  # compiled here, outside the profiled range
            runs.append((f"{kind} {shape} [{n}, {k}]", launch))
    torch.cuda.synchronize()
    for number, (name, _) in enumerate(runs):
        print(f"launch {number}: {name}", flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for _, launch in runs:
        launch()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
