"""The fused MoE kernel (kernels/fused_moe.py) against the torch reference on one MoE layer of a named
shape (Qwen3-30B-A3B by default: 128 experts, 8 per token, hidden 2048, expert width 768), bf16, for
token counts from decode to prefill. Each row: median milliseconds of both (CUDA events), the fused
kernel's and its alignment's inside a CUDA graph (as decode runs them), the expert weight bytes the
step must read (the distinct experts its tokens picked) over the graph time as GB/s, and the matmul
rate in TFLOP/s; compare with `bench_engine.py ceilings` from the same call. JSON on stdout (and --out).

    python benchmarks/gpu/bench_moe.py [--shape qwen3-30b-a3b] [--tokens 1,8,64,256,1024,4096] [--out FILE]

With --sweep, each GEMM (gate/up, down) is timed alone under every candidate (BLOCK_M, BLOCK_N, BLOCK_K,
warps, stages) at each token count (compiled first in parallel processes), and each token count's best
BLOCK_M (the two GEMMs share the alignment) with its best configs is printed: the rows of
kernels/fused_moe.py's CONFIGS. With --sweep --weights FORMAT (one of them) the quantized experts'
kernel is swept over the experts held in that format (the K tile then divides the format's group).

With --weights, the experts are held in each listed format (kernels/fused_moe_quant.py) and the fused
kernel is timed in a CUDA graph against bf16 at each token count: bf16, fp8 (e4m3, a scale per row),
fp8-block (a scale per row and 128 columns: the kernel's work for [128, 128] blocks), int4 (symmetric
groups of 128), int4-zp (with zero points), int8 (a scale per row: compressed-tensors' INT8 experts),
int8-g128-zp (groups of 128 with zero points: GPTQ 8-bit's). Each row: graph ms, the experts' bytes
read over it as GB/s, the speedup over bf16, and the error against the reference on the same
(dequantized) weights.

    python benchmarks/gpu/bench_moe.py --weights bf16,fp8,int4,int4-zp,int8,int8-g128-zp [--tokens ...]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import cuda_time  # noqa: E402
from shapes import SHAPES  # noqa: E402

from tokenmill.kernels import fused_moe, fused_moe_quant, reference  # noqa: E402
from tokenmill.kernels.quant_reference import (  # noqa: E402
    QuantExperts,
    quantize_experts_fp8,
    quantize_experts_int4,
)

SWEEP_TOKENS = "2,8,32,64,128,256,512,1024,2048,4096"  # (T*k a multiple of 16: one compiled variant)


def candidates() -> list[tuple[int, int, int, int, int]]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) whose pipeline fits shared memory."""
    fits = []
    space = itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (64, 128, 256), (4, 8), (2, 3, 4, 5))
    for bm, bn, bk, warps, stages in space:
        tile, shared = bm * bn, stages * (bm + bn) * bk * 2
        if shared <= 160 * 1024 and (warps == 4 and tile <= 16384 or warps == 8 and tile >= 8192):
            fits.append((bm, bn, bk, warps, stages))
    return fits


def graph_time(fn, calls: int = 20, repeats: int = 5) -> float:
    """Median seconds of one fn() inside a CUDA graph of `calls` calls (as the engine's decode runs it:
    no launch gaps)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_time(graph.replay, repeats) / calls


class Layer:
    """One MoE layer's weights and, per token count, its routing and hidden activations."""

    def __init__(self, shape: str, fmt: str = "bf16") -> None:
        config = SHAPES[shape]
        self.experts, self.top_k = config["num_experts"], config["num_experts_per_tok"]
        self.hidden, self.inter = config["hidden_size"], config["moe_intermediate_size"]
        self.device, self.dtype = torch.device("cuda"), torch.bfloat16
        self.gen = torch.Generator(device=self.device).manual_seed(0)
        self.w13 = self.randn(self.experts, 2 * self.inter, self.hidden) * 0.02
        self.w2 = self.randn(self.experts, self.hidden, self.inter) * 0.02
        self.gate = self.randn(self.experts, self.hidden) * 0.02
        self.fmt = fmt  # what gemm_call's GEMMs read: the experts held in one of WEIGHT_FORMATS
        self.held = (held_as(self.w13, fmt), held_as(self.w2, fmt))

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, device=self.device, dtype=self.dtype, generator=self.gen)

    def inputs(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.randn(tokens, self.hidden)
        probs = torch.softmax(x @ self.gate.T, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        return x, chosen, (weights / weights.sum(-1, keepdim=True)).to(self.dtype)

    def gemm_call(self, which: str, tokens: int, block_m: int, config: tuple[int, int, int, int]):
        """A closure running one of the two grouped GEMMs of a step of `tokens` under a config."""
        x, chosen, weights = self.inputs(tokens)
        alignment = fused_moe.align_by_expert(chosen, self.experts, block_m)
        layout = (*alignment, weights.reshape(-1).contiguous(), self.top_k, block_m)
        if which == "gate_up":
            a, w, by_token, weighted = x, self.held[0], True, False
            out = x.new_empty(tokens * self.top_k, w.shape[1])
        else:
            a, w, by_token, weighted = self.randn(tokens * self.top_k, self.inter), self.held[1], False, True
            out = x.new_zeros(tokens * self.top_k, w.shape[1])
        gemm = fused_moe._gemm if self.fmt == "bf16" else fused_moe_quant.quant_gemm
        return lambda: gemm(a, w, out, layout, by_token, weighted, config)


WEIGHT_FORMATS = ("bf16", "fp8", "fp8-block", "int4", "int4-zp", "int8", "int8-g128-zp")


def held_as(weight: torch.Tensor, fmt: str) -> torch.Tensor | QuantExperts:
    """Dense experts [E, N, K] in one of WEIGHT_FORMATS."""
    if fmt == "bf16":
        return weight
    if fmt == "fp8":
        return quantize_experts_fp8(weight)
    if fmt == "fp8-block":
        experts, rows, columns = weight.shape
        groups = weight.float().reshape(experts, rows, -1, 128)
        scale = groups.abs().amax(-1).clamp(min=1e-12) / 448
        q = (groups / scale[..., None]).to(torch.float8_e4m3fn).reshape(weight.shape)
        return QuantExperts(q, scale, None, 128, columns)
    if fmt in ("int8", "int8-g128-zp"):  # compressed-tensors' INT8 experts; GPTQ 8-bit's, as loaded
        experts, rows, columns = weight.shape
        group = 128 if fmt == "int8-g128-zp" else columns
        groups = weight.float().reshape(experts, rows, -1, group)
        scale = groups.abs().amax(-1).clamp(min=1e-12) / 127
        q = torch.round(groups / scale[..., None]).clamp(-128, 127).to(torch.int8).reshape(weight.shape)
        zero = torch.zeros_like(scale) if fmt == "int8-g128-zp" else None  # (fp32, as the layer holds them)
        return QuantExperts(q, scale, zero, group, columns)
    held = quantize_experts_int4(weight, 128)
    if fmt == "int4-zp":  # (zero points of 0 in the scales' dtype, as the layer holds them)
        held = held._replace(zero=torch.zeros_like(held.scale))
    return held


def held_bytes(weight: torch.Tensor | QuantExperts) -> int:
    parts = [weight] if isinstance(weight, torch.Tensor) else [weight.data, weight.scale, weight.zero]
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def weight_formats(layer: Layer, tokens_list: list[int], formats: list[str]) -> list[dict]:
    """The fused kernel over the experts held in each format, at each token count (see above)."""
    held = {fmt: (held_as(layer.w13, fmt), held_as(layer.w2, fmt)) for fmt in formats}
    rows = []
    for tokens in tokens_list:
        x, chosen, weights = layer.inputs(tokens)
        distinct = int(torch.unique(chosen).numel())
        baseline = None
        for fmt in formats:
            w13, w2 = held[fmt]
            got = fused_moe.fused_moe(x, w13, w2, chosen, weights)
            want = reference.fused_moe(x, w13, w2, chosen, weights)
            error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            ms = 1e3 * graph_time(lambda: fused_moe.fused_moe(x, w13, w2, chosen, weights))  # noqa: B023
            baseline = ms if fmt == "bf16" else baseline
            read = distinct * (held_bytes(w13) + held_bytes(w2)) // layer.experts
            rows.append({
                "tokens": tokens,
                "weights": fmt,
                "experts_hit": distinct,
                "graph_ms": round(ms, 4),
                "graph_weight_gb_s": round(read / ms / 1e6, 1),
                "speedup_vs_bf16": round(baseline / ms, 2) if baseline else None,
                "max_rel_error": round(error, 5),
            })  # fmt: skip
            print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def _compile(shape: str, configs: list, fmt: str) -> int:
    """Run each config once so Triton's on-disk cache holds it (in a process of its own)."""
    layer = Layer(shape, fmt)
    for bm, *config in configs:
        for which in ("gate_up", "down"):
            # (out of resources: the timing pass skips it too)
            with contextlib.suppress(Exception):
                layer.gemm_call(which, 2, bm, tuple(config))()
    torch.cuda.synchronize()
    return len(configs)


def sweep(shape: str, tokens_list: list[int], workers: int, fmt: str = "bf16") -> dict:
    configs = candidates()
    print(f"{len(configs)} candidates, compiling on {workers} processes", file=sys.stderr)
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        parts = [configs[i::workers] for i in range(workers)]
        list(pool.map(_compile, [shape] * workers, parts, [fmt] * workers))
    layer = Layer(shape, fmt)
    rows = []
    for tokens in tokens_list:
        per_expert = tokens * layer.top_k / layer.experts
        # BLOCK_M past twice the average run only pads.
        widest = max(16, 2 * triton.next_power_of_2(int(per_expert) + 1))
        block_ms = [bm for bm in (16, 32, 64, 128) if bm <= widest]
        best: dict = {}
        for bm, *config in configs:
            if bm not in block_ms:
                continue
            for which in ("gate_up", "down"):
                try:
                    ms = 1e3 * graph_time(layer.gemm_call(which, tokens, bm, tuple(config)))
                except Exception:  # noqa: BLE001
                    continue
                if ms < best.get((bm, which), (float("inf"),))[0]:
                    best[(bm, which)] = (ms, tuple(config))
        timed = [bm for bm in block_ms if (bm, "down") in best and (bm, "gate_up") in best]
        totals = {bm: best[(bm, "gate_up")][0] + best[(bm, "down")][0] for bm in timed}
        bm = min(totals, key=totals.get)
        rows.append({
            "tokens": tokens,
            "pairs_per_expert": per_expert,
            "block_m": bm,
            "gate_up": list(best[(bm, "gate_up")][1]),
            "down": list(best[(bm, "down")][1]),
            "gate_up_ms": round(best[(bm, "gate_up")][0], 4),
            "down_ms": round(best[(bm, "down")][0], 4),
            "total_ms_by_block_m": {str(k): round(v, 4) for k, v in totals.items()},
        })  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {"shape": shape, "weights": fmt, "device": torch.cuda.get_device_name(), "sweep": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,8,64,256,1024,4096")
    parser.add_argument("--out")
    parser.add_argument("--sweep", action="store_true", help="tune the kernel's configs (see above)")
    parser.add_argument("--workers", type=int, default=12, help="processes compiling the sweep's candidates")
    parser.add_argument(
        "--weights",
        help=f"time the experts held in these formats (comma-separated of {', '.join(WEIGHT_FORMATS)})",
    )
    args = parser.parse_args()
    formats = args.weights.split(",") if args.weights else []
    unknown = [fmt for fmt in formats if fmt not in WEIGHT_FORMATS]
    if unknown:
        parser.error(f"--weights {','.join(unknown)}: choose from {', '.join(WEIGHT_FORMATS)}")
    if args.sweep and len(formats) > 1:
        parser.error("--sweep tunes one format at a time: give --weights one of them")
    if formats and not args.sweep:
        layer = Layer(args.shape)
        rows = weight_formats(layer, [int(t) for t in args.tokens.split(",")], formats)
        report = {"shape": args.shape, "device": torch.cuda.get_device_name(), "weight_formats": rows}
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return
    if args.sweep:
        tokens = args.tokens if args.tokens != parser.get_default("tokens") else SWEEP_TOKENS
        report = sweep(args.shape, [int(t) for t in tokens.split(",")], args.workers, *formats)
        text = json.dumps(report, indent=2)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
        return
    layer = Layer(args.shape)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x, chosen, weights = layer.inputs(tokens)
        w13, w2, top_k, hidden, inter = layer.w13, layer.w2, layer.top_k, layer.hidden, layer.inter
        got = fused_moe.fused_moe(x, w13, w2, chosen, weights)
        want = reference.fused_moe(x, w13, w2, chosen, weights)
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        fused_ms = 1e3 * cuda_time(lambda: fused_moe.fused_moe(x, w13, w2, chosen, weights), 20)  # noqa: B023
        reference_ms = 1e3 * cuda_time(lambda: reference.fused_moe(x, w13, w2, chosen, weights), 5)  # noqa: B023
        graph_ms = 1e3 * graph_time(lambda: fused_moe.fused_moe(x, w13, w2, chosen, weights))  # noqa: B023
        align_ms = 1e3 * graph_time(lambda: fused_moe.align_by_expert(chosen, layer.experts, 16))  # noqa: B023
        distinct = int(torch.unique(chosen).numel())
        weight_bytes = distinct * 3 * hidden * inter * 2
        flops = 2 * tokens * top_k * 3 * hidden * inter
        rows.append({
            "tokens": tokens,
            "experts_hit": distinct,
            "fused_ms": round(fused_ms, 4),
            "reference_ms": round(reference_ms, 4),
            "fused_graph_ms": round(graph_ms, 4),
            "align_graph_ms": round(align_ms, 4),
            "speedup": round(reference_ms / fused_ms, 2),
            "graph_weight_gb_s": round(weight_bytes / graph_ms / 1e6, 1),
            "graph_tflop_s": round(flops / graph_ms / 1e9, 1),
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
