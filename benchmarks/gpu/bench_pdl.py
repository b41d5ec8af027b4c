"""Batch-1 decode step of one model, in variants captured side by side in one process: with and without
programmatic dependent launch (kernels/pdl.py), and for a bf16 model cuBLAS against
kernels/skinny_gemm.py's dense_gemv. Each variant is its own CUDA graph over the
same weights and KV cache; the graphs are replayed in turns, so that the ratios hold within the call.
Every variant's logits are compared with the first variant's (same kernels: bitwise; else the largest
difference), and replayed twice more to see that they do not change (a PDL kernel that read before its
wait would show here first).

    python benchmarks/gpu/bench_pdl.py [--shape llama-3.1-8b] [--quantization fp8|int4] [--context 256]
                                       [--probes] [--out FILE]

--probes adds variants that leave launches out of the step (their logits are wrong; only their time
means something): what each small launch of a layer costs the step as captured, the part of the step
that moves no weight and that fusing them could win (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import ceilings, dummy_llm  # noqa: E402
from shapes import decode_weight_bytes, kv_bytes_per_token  # noqa: E402

import tokenmill.kernels.attention as attention_kernels  # noqa: E402
import tokenmill.layers.attention as attention_layer  # noqa: E402
import tokenmill.layers.dense as dense  # noqa: E402
import tokenmill.layers.fused_linear as fused_linear  # noqa: E402
from tokenmill.kernels import pdl, skinny_gemm  # noqa: E402
from tokenmill.worker.cuda_graphs import DecodeGraphs  # noqa: E402

_PDL_ENABLED = pdl.enabled


# layers/fused_linear.py's GEMV_FUSION parts a variant folds into the one-row GEMVs.
_ACT = frozenset({"act"})


def variants(quantization: str | None) -> list[dict]:
    """Each variant's name, PDL, dense GEMV and PDL on the 4-bit one-row kernel: a bf16 model with cuBLAS
    and with dense_gemv; a quantized one with and without PDL; each with the one-row GEMVs' first weight
    tile loaded after the PDL wait as before skinny_gemm.GEMV_EARLY (late) or their first 2 and 4 tiles
    before it (early2, early4), with SiLU-and-multiply
    folded into the gate/up GEMV (fused_linear.GEMV_FUSION "act"), and that with the metadata and a
    decode's earlier keys read after the PDL wait (pdl.EARLY_READS off: late-reads), and with the
    rotary and KV store done by the decode attention's launch instead of their own (layers/attention.py
    DECODE_ROTARY on: rotary-in-attention), and with the decode's KV splits merged in its own launch
    (kernels/attention.py MERGE_IN_KERNEL: merge-in-launch). int4 also without the packed-fp16 kernel's
    paired words and vector activation loads, with its one-row GEMV launched plainly, and the fp32 one-row
    kernel so launched, as before the packed-fp16 one."""
    if quantization is None:
        return [
            {"name": "cublas-nopdl", "pdl": False, "gemv": False},
            {"name": "cublas-pdl", "pdl": True, "gemv": False},
            {"name": "triton-nopdl", "pdl": False, "gemv": True},
            {"name": "triton-pdl", "pdl": True, "gemv": True},
            {"name": "triton-pdl-late", "pdl": True, "gemv": True, "switches": {"GEMV_EARLY": 0}},
            {"name": "triton-pdl-fuse-act", "pdl": True, "gemv": True, "fusion": _ACT},
            {"name": "triton-pdl-fuse-act-late-reads", "pdl": True, "gemv": True, "fusion": _ACT,
             "early_reads": False},
            {"name": "triton-pdl-fuse-act-rotary-in-attention", "pdl": True, "gemv": True, "fusion": _ACT,
             "decode_rotary": True},
            *_early("triton-pdl-fuse-act", {"gemv": True}),
            {"name": "triton-pdl-fuse-act-merge-in-launch", "pdl": True, "gemv": True, "fusion": _ACT,
             "decode_merge": True},
        ]  # fmt: skip
    out = [{"name": "nopdl", "pdl": False}, {"name": "pdl", "pdl": True}]
    out.append({"name": "pdl-late", "pdl": True, "switches": {"GEMV_EARLY": 0}})
    out.append({"name": "pdl-fuse-act", "pdl": True, "fusion": _ACT})
    out.append({"name": "pdl-fuse-act-late-reads", "pdl": True, "fusion": _ACT, "early_reads": False})
    out.append(
        {"name": "pdl-fuse-act-rotary-in-attention", "pdl": True, "fusion": _ACT, "decode_rotary": True}
    )
    out.extend(_early("pdl-fuse-act", {}))
    out.append({"name": "pdl-fuse-act-merge-in-launch", "pdl": True, "fusion": _ACT, "decode_merge": True})
    if quantization == "int4":
        # The packed-fp16 kernel without its defaults, with the default act: two words' products summed
        # in fp16 before fp32 (skinny_gemm.GEMV4_PAIRED), each word's activations in one vector load
        # (GEMV4_WIDE_X).
        for name, switches in (
            ("unpaired", {"GEMV4_PAIRED": False}),
            ("narrow-x", {"GEMV4_WIDE_X": False}),
            ("unpaired-narrow-x", {"GEMV4_PAIRED": False, "GEMV4_WIDE_X": False}),
        ):
            out.append({"name": f"pdl-fuse-act-{name}", "pdl": True, "fusion": _ACT, "switches": switches})
        out.append({"name": "pdl-gemv4-plain", "pdl": True, "switches": {"GEMV4_PDL": False}})
        # The one-row 4-bit kernel in fp32 arithmetic, launched plainly: the step before 2026-12-03's
        # packed-fp16 kernel.
        plain_fp32 = {"GEMV4_F16X2": False, "GEMV4_PDL": False}
        out.append({"name": "pdl-gemv4-fp32-plain", "pdl": True, "switches": plain_fp32})
    return out


def _early(base: str, extra: dict) -> list[dict]:
    """The default step (PDL, SiLU-and-multiply in the gate/up GEMV) with the one-row GEMVs' first 2 and
    4 weight tiles loaded before the PDL wait (skinny_gemm.GEMV_EARLY; at 4 the whole of the 8B's FP8 O
    and QKV weights)."""
    variant = {"pdl": True, "fusion": _ACT} | extra
    return [variant | {"name": f"{base}-early{tiles}", "switches": {"GEMV_EARLY": tiles}} for tiles in (2, 4)]


def _no_norm(x, *rest):
    """rms_norm / fused_add_rms_norm without a launch: the input (and the residual) as they are."""
    return x if len(rest) == 2 else (x, rest[0])


def _no_rotary(positions, q, k, *rest):
    """rotary_and_write_kv_cache without a launch: q and k unrotated, nothing stored."""
    return q, k


def _no_attention(query, *args, **kwargs):
    """paged_attention without a launch: an output of the right shape, unwritten."""
    return torch.empty_like(query)


def probes() -> list[dict]:
    """Variants that leave a layer's small launches out (wrong logits, real times), with the engine's
    defaults otherwise: both norms, the rotary-and-KV-store, the split merge, attention with its merge,
    all of them; attention over 1 and 4 KV splits instead of the graph's count (1: no merge), and its
    decode tile with 1 and 2 pipeline stages instead of 3, 2 and 8 warps instead of 4, 32 and 128 keys
    instead of 64 (they are timing probes too: a step's output is right with them, but they are not the
    engine's default)."""
    out = [
        {"name": "probe-no-norms", "kernels": {"rms_norm": _no_norm, "fused_add_rms_norm": _no_norm}},
        # The separate rotary-and-KV-store launch (DECODE_ROTARY off, whatever the layer's default).
        {
            "name": "probe-no-rotary",
            "kernels": {"rotary_and_write_kv_cache": _no_rotary},
            "decode_rotary": False,
        },
        {"name": "probe-no-merge", "merge": False},
        {"name": "probe-no-attention", "kernels": {"paged_attention": _no_attention}},
        {"name": "probe-splits-1", "splits": 1},
        {"name": "probe-splits-4", "splits": 4},
        # The decode tile's software pipeline (shared memory for num_stages copies of a key/value tile).
        {"name": "probe-attn-stages-1", "tile": {"num_stages": 1}},
        {"name": "probe-attn-stages-2", "tile": {"num_stages": 2}},
        # Its warps and keys a tile.
        {"name": "probe-attn-warps-2", "tile": {"num_warps": 2}},
        {"name": "probe-attn-warps-8", "tile": {"num_warps": 8}},
        {"name": "probe-attn-keys-32", "tile": {"block_n": 32}},
        {"name": "probe-attn-keys-128", "tile": {"block_n": 128}},
    ]
    every = {
        "rms_norm": _no_norm, "fused_add_rms_norm": _no_norm,
        "rotary_and_write_kv_cache": _no_rotary, "paged_attention": _no_attention,
    }  # fmt: skip
    out.append({"name": "probe-gemvs-only", "kernels": every})
    for probe in out:
        probe.update(pdl=True, fusion=_ACT)
    return out


@contextlib.contextmanager
def patched(model, variant: dict):
    """The variant's kernels in every layer that holds a Kernels tuple, its KV split count and merge in
    kernels/attention.py; restored on exit."""
    replace, saved = dict(variant.get("kernels", {})), []
    splits, merge = variant.get("splits"), variant.get("merge", True)
    merge_splits, decode_config = attention_kernels.merge_splits, attention_kernels.decode_config
    if "tile" in variant:
        attention_kernels.decode_config = lambda *args, **kwargs: decode_config(*args, **kwargs)._replace(
            **variant["tile"]
        )
    if splits is not None:
        paged = attention_kernels.paged_attention
        replace["paged_attention"] = functools.partial(paged, num_kv_splits=splits)
    for module in model.modules():
        kernels = getattr(module, "kernels", None)
        if replace and hasattr(kernels, "_replace"):
            saved.append((module, kernels))
            module.kernels = kernels._replace(**replace)
    if not merge:
        attention_kernels.merge_splits = lambda *args: None
    try:
        yield
    finally:
        for module, kernels in reversed(saved):
            module.kernels = kernels
        attention_kernels.merge_splits, attention_kernels.decode_config = merge_splits, decode_config


def capture(runner, variant: dict, context: int) -> DecodeGraphs:
    pdl.enabled = (lambda x: x.is_cuda) if variant["pdl"] else (lambda x: False)
    dense.DENSE_GEMV = variant.get("gemv", True)
    # No fusion unless the variant names parts (the engine's default, "act", is the fuse-act variants).
    fusion, fused_linear.GEMV_FUSION = fused_linear.GEMV_FUSION, variant.get("fusion", frozenset())
    early_reads, pdl.EARLY_READS = pdl.EARLY_READS, variant.get("early_reads", True)
    decode_rotary = attention_layer.DECODE_ROTARY  # the layer's default unless the variant names one
    attention_layer.DECODE_ROTARY = variant.get("decode_rotary", decode_rotary)
    decode_merge = attention_kernels.MERGE_IN_KERNEL  # likewise the Triton decode's merge in its launch
    attention_kernels.MERGE_IN_KERNEL = variant.get("decode_merge", decode_merge)
    try:
        with skinny_gemm.switches(**variant.get("switches", {})), patched(runner.model, variant):
            graphs = DecodeGraphs(
                runner.model, 1, runner.max_blocks_per_seq, runner.max_model_len, runner.device
            )
            graphs.capture()
    finally:
        pdl.enabled = _PDL_ENABLED
        fused_linear.GEMV_FUSION = fusion
        pdl.EARLY_READS = early_reads
        attention_layer.DECODE_ROTARY = decode_rotary
        attention_kernels.MERGE_IN_KERNEL = decode_merge
    # One request at `context` tokens over distinct blocks; its new token into a real slot.
    block = runner.block_size
    blocks = min(-(-context // block), graphs.block_tables.shape[1])
    graphs.block_tables[0, :blocks] = torch.arange(1, blocks + 1, dtype=torch.int32)
    graphs.seq_lens[0] = context
    graphs.positions[0] = context - 1
    graphs.slot_mapping[0] = block + context - 1
    graphs.input_ids[0] = 17
    return graphs


def time_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--probes", action="store_true", help="add the variants that leave launches out")
    parser.add_argument("--variants", help="a comma list of variant names to run (the first is the base)")
    parser.add_argument("--out")
    args = parser.parse_args()
    llm = dummy_llm(
        args.shape, max_num_seqs=1, enforce_eager=True, quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )  # fmt: skip
    runner = llm.engine.runner
    chosen = variants(args.quantization) + (probes() if args.probes else [])
    if args.variants:
        by_name = {variant["name"]: variant for variant in chosen}
        unknown = [name for name in args.variants.split(",") if name not in by_name]
        if unknown:
            raise ValueError(f"--variants: unknown {unknown}; these exist: {sorted(by_name)}")
        chosen = [by_name[name] for name in args.variants.split(",")]
    graphs = {}
    for variant in chosen:
        try:
            graphs[variant["name"]] = capture(runner, variant, args.context)
        except Exception as error:  # a probe that cannot capture is reported, the others still run
            if not variant["name"].startswith("probe-"):
                raise
            print(f"{variant['name']}: not captured: {error!r}", flush=True)
    names = list(graphs)
    logits = {}
    for key in names:
        graphs[key].graphs[1].replay()
        logits[key] = graphs[key].logits[1].float().clone()
    first = logits[names[0]]
    times: dict[str, list[float]] = {key: [] for key in names}
    for round_ in range(args.rounds):
        order = names if round_ % 2 == 0 else names[::-1]
        for key in order:
            times[key].append(time_ms(graphs[key].graphs[1], args.replays))
    stable = {}
    for key in names:
        graphs[key].graphs[1].replay()
        stable[key] = bool(torch.equal(graphs[key].logits[1].float(), logits[key]))
    weight_dtype = {"fp8": "fp8", "int4": "int4"}.get(args.quantization or "", "bf16")
    bytes_per_step = (
        decode_weight_bytes(args.shape, weight_dtype) + kv_bytes_per_token(args.shape) * args.context
    )
    copy_bandwidth = ceilings(args)["copy_bandwidth_Bps"]
    floor_ms = bytes_per_step / copy_bandwidth * 1e3
    result = {
        "copy_bandwidth_Bps": copy_bandwidth,
        "floor_ms": floor_ms,
        "shape": args.shape,
        "quantization": args.quantization or "none",
        "context": args.context,
        "device": torch.cuda.get_device_name(),
        "variants": {
            key: {
                "step_ms_median": statistics.median(times[key]),
                "step_ms_min": min(times[key]),
                "vs_first": statistics.median(times[key]) / statistics.median(times[names[0]]),
                "of_roofline": floor_ms / statistics.median(times[key]),
                "max_abs_logit_diff_vs_first": (logits[key] - first).abs().max().item(),
                "bitwise_vs_first": bool(torch.equal(logits[key], first)),
                "stable_over_replays": stable[key],
            }
            for key in names
        },
        "bytes_per_step": bytes_per_step,
    }
    for key, row in result["variants"].items():
        print(
            f"{key:24s} {row['step_ms_median']:.4f} ms (min {row['step_ms_min']:.4f}) "
            f"x{row['vs_first']:.3f} roofline {row['of_roofline']:.1%} "
            f"diff {row['max_abs_logit_diff_vs_first']:.3g} "
            f"bitwise {row['bitwise_vs_first']} stable {row['stable_over_replays']}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as file:
            json.dump(result, file, indent=1)
    del graphs, llm
    gc.collect()


if __name__ == "__main__":
    main()
