"""The fused MoE kernel (kernels/fused_moe.py) against the torch reference on one MoE layer of a named
shape (Qwen3-30B-A3B by default: 128 experts, 8 per token, hidden 2048, expert width 768), bf16, for
token counts from decode to prefill. Each row: median milliseconds of both (CUDA events), the expert
weight bytes the step must read (the distinct experts its tokens picked) as GB/s, and the matmul rate
in TFLOP/s; compare with `bench_engine.py ceilings` from the same call. JSON on stdout (and --out).

    python benchmarks/gpu/bench_moe.py [--shape qwen3-30b-a3b] [--tokens 1,8,64,256,1024,4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import cuda_time  # noqa: E402
from shapes import SHAPES  # noqa: E402

from tokenmill.kernels import fused_moe, reference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096")
    parser.add_argument("--out")
    args = parser.parse_args()
    config = SHAPES[args.shape]
    experts, top_k = config["num_experts"], config["num_experts_per_tok"]
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, device=device, dtype=dtype, generator=gen) * 0.02
    gate = torch.randn(experts, hidden, device=device, dtype=dtype, generator=gen) * 0.02
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, generator=gen)
        probs = torch.softmax(x @ gate.T, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
        got = fused_moe.fused_moe(x, w13, w2, chosen, weights)
        want = reference.fused_moe(x, w13, w2, chosen, weights)
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        fused_ms = 1e3 * cuda_time(lambda: fused_moe.fused_moe(x, w13, w2, chosen, weights), 20)  # noqa: B023
        reference_ms = 1e3 * cuda_time(lambda: reference.fused_moe(x, w13, w2, chosen, weights), 5)  # noqa: B023
        distinct = int(torch.unique(chosen).numel())
        weight_bytes = distinct * 3 * hidden * inter * 2
        flops = 2 * tokens * top_k * 3 * hidden * inter
        rows.append({
            "tokens": tokens,
            "experts_hit": distinct,
            "fused_ms": round(fused_ms, 4),
            "reference_ms": round(reference_ms, 4),
            "speedup": round(reference_ms / fused_ms, 2),
            "fused_weight_gb_s": round(weight_bytes / fused_ms / 1e6, 1),
            "fused_tflop_s": round(flops / fused_ms / 1e9, 1),
            "max_rel_error": round(error, 5),
        })  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr)
    report = {"shape": args.shape, "device": torch.cuda.get_device_name(), "results": rows}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
