"""Decode attention variants at batch 16 x 32k context (or --case B x L: 256 x 544 is a throughput
run's decode), Llama-3.1-8B's layout, us per layer, against the kernel as it is: the A/B behind
docs/performance.md's FP8 KV entries, rerunnable.

Each variant is the engine's own kernel with a launch option changed: the tile (block of keys, warps,
stages: `attention.decode_config`), a register cap (maxnreg), KV splits, the page layout (token-major as
the engine allocates it, or head-major, which the kernel takes through strides), and the FP8 cache's
whole tiles read as pairs widened in registers (`attention.FP8_PAIR_LOADS`). (The variants built by
editing the kernel's text, V stored transposed, integer e4m3 conversion and keys as the MMA's M
dimension, were measured and dropped: docs/performance.md, nineteenth to twenty-first sessions.) Each
timing is a CUDA graph of launches over two copies of the pool (bench_kernels.time_us).

    python benchmarks/gpu/ab_attention.py [--groups base,layout,occupancy,tiles,pairs,cuda,cuda-layout,
                                                    cuda-step,pages,cuda-ahead] [--case 16x32768]
                                                    [--pages random|ordered] [--out FILE]
(tiles: the FP8 cache's tile, warps and stages without KV splits, for many short requests; pairs: the
pair loads against the value-by-value ones at the engine's own tiles; cuda: the CUDA decode over the FP8
cache, kernels/fp8_decode_cuda.py, by its splits; cuda-layout: the CUDA decode and the bf16 Triton one at
the engine's tiles over token-major and head-major pages; cuda-step: the CUDA decode over head-major pages
with the step's rotary and K/V store in its launch, as a decode step has it, against without; pages: the
defaults over pages in random order and in the block pool's order; cuda-ahead: the CUDA decode over
head-major pages in the pool's order by tiles ahead, warps and splits, and with the splits merged in its
launch)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import time_us  # noqa: E402

from tokenmill.kernels import StepRotary, attention, fp8_decode_cuda, pdl, reference  # noqa: E402
from tokenmill.worker import kv_layout  # noqa: E402

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 32768, 32, 8, 128, 16


class _Launch:
    """The attention kernel with extra launch options (maxnreg) added to every launch."""

    def __init__(self, kernel) -> None:
        self.kernel, self.extra = kernel, {}

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.extra)


def main() -> int:
    global BATCH, CONTEXT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="base,layout,occupancy,pairs")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--case", default="16x32768", help="requests x context (a multiple of 16)")
    parser.add_argument("--pdl", action="store_true", help="launch with PDL, as the engine's graphs do")
    parser.add_argument("--pages", choices=("random", "ordered"), default="random")
    args = parser.parse_args()
    if args.pdl:
        pdl.in_graphs().__enter__()  # for the whole run
    BATCH, CONTEXT = (int(v) for v in args.case.split("x"))
    groups = set(args.groups.split(","))
    launcher = _Launch(attention._paged_attention_kernel)
    attention._paged_attention_kernel = launcher
    decode_config = attention.decode_config
    dev = "cuda"
    blocks_per_seq = CONTEXT // BLOCK
    copies = 2
    num_blocks = copies * BATCH * blocks_per_seq
    torch.manual_seed(0)
    k_bf = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_bf = torch.randn_like(k_bf)
    k8, v8 = k_bf.to(torch.float8_e4m3fn), v_bf.to(torch.float8_e4m3fn)

    def head_major(
        t: torch.Tensor,
    ) -> torch.Tensor:  # as the engine allocates it with TOKENMILL_KV_LAYOUT=hnd
        copy = kv_layout.empty_kv_cache(*t.shape, t.dtype, t.device, "hnd")
        return copy.copy_(t)

    # Pages in random order (the default), or each request's pages consecutive, request after request, as
    # a fresh engine's block pool hands them out (--pages ordered, or the group `pages` beside random).
    page_orders = {
        "random": torch.randperm(num_blocks, device=dev),
        "ordered": torch.arange(num_blocks, device=dev),
    }
    page_orders = {k: v.to(torch.int32).view(copies, BATCH, blocks_per_seq) for k, v in page_orders.items()}
    pages = page_orders[args.pages]
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=dev)
    starts = torch.arange(BATCH + 1, dtype=torch.int32, device=dev)
    query = torch.randn(BATCH, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    caches = {torch.bfloat16: (k_bf, v_bf), torch.float8_e4m3fn: (k8, v8)}
    want: dict[tuple[torch.dtype, str], torch.Tensor] = {}  # the reference by cache dtype and page order

    def reference_for(dtype: torch.dtype, order: str) -> torch.Tensor:
        if (dtype, order) not in want:  # computed once, when a variant first needs it (each takes seconds)
            k, v = caches[dtype]
            want[dtype, order] = reference.paged_attention(
                query, k, v, page_orders[order][0], seq_lens, starts, scale
            ).float()
        return want[dtype, order]

    results: dict[str, dict] = {}

    def run(
        name, k_cache, v_cache, splits, extra=None, config=None, pairs=False, cuda=False, rotary=None,
        order=args.pages,
    ) -> None:  # fmt: skip
        pages = page_orders[order]
        launcher.extra = extra or {}
        fp8_decode_cuda.DECODE_CUDA = cuda
        attention.decode_config = (lambda *a, **k: config) if config else decode_config
        attention.FP8_PAIR_LOADS = pairs
        calls = itertools.count()

        def step() -> None:
            copy = next(calls) % copies
            attention.paged_attention(
                query, k_cache, v_cache, pages[copy], seq_lens, starts, scale, out,
                max_query_len=1, max_seq_len=CONTEXT, num_kv_splits=splits,
                rotary=rotary[copy] if rotary else None,
            )  # fmt: skip

        try:
            got = attention.paged_attention(
                query, k_cache, v_cache, pages[0], seq_lens, starts, scale, max_query_len=1,
                max_seq_len=CONTEXT, num_kv_splits=splits,
            ).float()  # fmt: skip
            ref = reference_for(k_cache.dtype, order)
            us = time_us(step, 8, replays=30)
            results[name] = {
                "us": us,
                "kv_tb_per_s": 2 * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * k_cache.element_size() / us / 1e6,
            }
            if rotary is None:  # (a rotated query and the step's stored key are not the reference's)
                results[name]["max_abs_err"] = (got - ref).abs().max().item()
                results[name]["rel_rms_err"] = (
                    (got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
                ).item()
        except Exception as error:  # noqa: BLE001 - a variant that does not build is reported
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, json.dumps(results[name]), flush=True)

    tile = attention.TileConfig
    if "base" in groups:
        for splits in (2, 4):
            run(f"bf16_s{splits}", k_bf, v_bf, splits)
            run(f"fp8_s{splits}", k8, v8, splits)
    if "layout" in groups:
        for splits in (2, 4):
            run(f"bf16_head_major_s{splits}", head_major(k_bf), head_major(v_bf), splits)
            run(f"fp8_head_major_s{splits}", head_major(k8), head_major(v8), splits)
    if "occupancy" in groups:
        for extra, config, splits in (
            ({"maxnreg": 168}, None, (4, 8)), ({"maxnreg": 128}, None, (4, 8)),
            ({}, tile(16, 64, 4, 2), (2, 8)), ({}, tile(16, 32, 4, 3), (4, 16)),
            ({}, tile(16, 256, 4, 3), (2,)),
        ):  # fmt: skip
            for n in splits:
                label = f"{tuple(config) if config else ''}{extra or ''}"
                run(f"fp8_{label}_s{n}", k8, v8, n, extra, config)
    if "tiles" in groups:
        for splits in (1, 2):
            run(f"bf16_s{splits}", k_bf, v_bf, splits)
            run(f"fp8_s{splits}", k8, v8, splits)
        for extra, config in (
            ({}, tile(16, 128, 4, 2)), ({}, tile(16, 128, 8, 3)), ({"maxnreg": 128}, None),
            ({}, tile(16, 64, 4, 2)), ({}, tile(16, 64, 4, 3)), ({}, tile(16, 64, 4, 4)),
            ({}, tile(16, 64, 2, 3)), ({}, tile(16, 32, 4, 3)), ({}, tile(16, 32, 2, 3)),
        ):  # fmt: skip
            label = f"{tuple(config) if config else ''}{extra or ''}"
            run(f"fp8_{label}_s1", k8, v8, 1, extra, config)
    if "pairs" in groups:
        # The engine's own tile for the case (its splits: None), then its other candidates, each read value
        # by value and as pairs; bf16 for the bandwidth the FP8 cache is measured against.
        run("bf16_default", k_bf, v_bf, None)
        for splits in (None, 1, 2, 4, 8):
            for pairs in (False, True):
                run(f"fp8{'_pairs' if pairs else ''}_s{splits or 'default'}", k8, v8, splits, pairs=pairs)
        for config in (tile(16, 64, 2, 3), tile(16, 128, 4, 3), tile(16, 64, 4, 3)):
            for pairs in (False, True):
                run(f"fp8{'_pairs' if pairs else ''}_{tuple(config)}_s1", k8, v8, 1, None, config, pairs)
        # Tiles the registers freed by the pairs (255 -> 162-177) may now hold.
        for config in (tile(16, 256, 4, 3), tile(16, 128, 2, 3)):
            run(f"fp8_pairs_{tuple(config)}_sdefault", k8, v8, None, None, config, True)
        # Read as pairs, the loop keeps clear of spills under a register cap (sm_90 SASS: at 168, 3 local
        # loads in the 64-key two-warp loop, 6 blocks a multiprocessor instead of 4; the 128-key
        # four-warp one 3 instead of 2), so more warps hide the loads' latency.
        for cap in (168, 128):
            run(f"fp8_pairs_maxnreg{cap}_sdefault", k8, v8, None, {"maxnreg": cap}, None, True)
            for splits in (1, 4):
                run(f"fp8_pairs_maxnreg{cap}_s{splits}", k8, v8, splits, {"maxnreg": cap}, None, True)
    if "cuda-short" in groups:  # the engine's defaults only
        run("bf16_default", k_bf, v_bf, None)
        run("fp8_default", k8, v8, None)
        run("fp8_cuda_sdefault", k8, v8, None, cuda=True)
        if args.pdl:  # the CUDA decode's first tiles after the PDL wait instead of before it
            pdl.EARLY_READS = False
            run("fp8_cuda_late_reads_sdefault", k8, v8, None, cuda=True)
            pdl.EARLY_READS = True
    if "cuda" in groups:
        # The CUDA decode over the FP8 cache (kernels/fp8_decode_cuda.py) by its KV splits, against the
        # Triton kernels at their own splits.
        run("bf16_default", k_bf, v_bf, None)
        run("fp8_default", k8, v8, None)
        for splits in (None, 1, 2, 4, 8, 16, 32):
            run(f"fp8_cuda_s{splits or 'default'}", k8, v8, splits, cuda=True)
        default = fp8_decode_cuda.CONFIG
        # The runs above take the engine's tiles (launch_config: one-warp blocks for many requests, four-warp
        # ones below). Fewer warps a block: more blocks a multiprocessor (registers: ~207 a thread at one
        # tile ahead, 243 at two), so one block's first loads and final merge hide behind the others'
        # tiles; (4, 1, 3) caps the registers for three four-warp blocks (it spills).
        for config in ((4, 1), (4, 2), (8, 1), (8, 2), (2, 2), (2, 1), (1, 1), (1, 2), (4, 1, 3)):
            fp8_decode_cuda.CONFIG = fp8_decode_cuda.DecodeConfig(*config)
            for splits in (None, 1, 2, 4):
                name = "_".join(f"{v}{u}" for v, u in zip(config, ("w", "a", "b")))
                run(f"fp8_cuda_{name}_s{splits or 'default'}", k8, v8, splits, cuda=True)
        fp8_decode_cuda.CONFIG = default
    if "cuda-layout" in groups:
        # The engine's tiles over token-major and head-major pages ([block, head, slot, dim] through the same
        # strides, as worker/kv_layout.py allocates them: a KV head's rows of a page contiguous, where
        # token-major they are 128-byte pieces 1 KB apart), the CUDA FP8 decode by splits and the bf16
        # Triton one: the H200 read 3.94 against 3.70 TB/s so for FP8 (forty-ninth session).
        split_choices = (None, 2, 4) if BATCH * KV_HEADS < 512 else (None,)  # many requests: one split
        run("bf16_default", k_bf, v_bf, None)
        for splits in split_choices:
            run(f"fp8_cuda_token_major_s{splits or 'default'}", k8, v8, splits, cuda=True)
        k8_hm, v8_hm = head_major(k8), head_major(v8)
        for splits in split_choices:
            run(f"fp8_cuda_head_major_s{splits or 'default'}", k8_hm, v8_hm, splits, cuda=True)
        del k8_hm, v8_hm
        run("bf16_head_major_default", head_major(k_bf), head_major(v_bf), None)
    if "cuda-step" in groups:
        # The CUDA decode over head-major pages as a decode step launches it: rotating the query and the
        # step's key and storing its key and value in the launch (StepRotary, the split that holds the key
        # doing it), against the plain launch; with --pdl, PDL as in the engine's graphs. Where the 32k
        # step's attention took ~14% longer than the plain kernel (H200, forty-ninth session).
        positions = torch.full((BATCH,), CONTEXT - 1, dtype=torch.int64, device=dev)
        cos_sin = torch.randn(CONTEXT, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        key = torch.randn(BATCH, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
        value = torch.randn_like(key)
        last = (CONTEXT - 1) // BLOCK
        rotaries = [
            StepRotary(
                positions, cos_sin, key, value, pages[c, :, last].long() * BLOCK + (CONTEXT - 1) % BLOCK
            )
            for c in range(copies)
        ]
        k8_hm, v8_hm = head_major(k8), head_major(v8)
        for splits in (None, 2):
            run(f"fp8_cuda_head_major_plain_s{splits or 'default'}", k8_hm, v8_hm, splits, cuda=True)
            run(f"fp8_cuda_head_major_rotary_s{splits or 'default'}", k8_hm, v8_hm, splits, cuda=True,
                rotary=rotaries)  # fmt: skip
        del k8_hm, v8_hm
        run("bf16_default", k_bf, v_bf, None)
        run("bf16_rotary_default", k_bf.clone(), v_bf.clone(), None, rotary=rotaries)
    if "cuda-ahead" in groups:
        # The CUDA decode over head-major pages in the block pool's order, by tiles and splits: on the H200
        # the engine's two-warp blocks, one tile ahead, read 3.94 TB/s at 16 x 32k with ~8 warps a
        # multiprocessor (4 blocks); two tiles ahead (240 registers, still 4 blocks) put 1.5x the bytes in
        # flight, and more splits of one-warp blocks more blocks (H100, fiftieth session: two ahead -1.2%).
        default = fp8_decode_cuda.CONFIG
        k8_hm, v8_hm = head_major(k8), head_major(v8)
        for config in ((2, 1), (2, 2), (1, 2), (1, 1), (4, 2), (2, 2, 4), (1, 2, 8)):
            fp8_decode_cuda.CONFIG = fp8_decode_cuda.DecodeConfig(*config)
            for splits in (4, 8):
                name = "_".join(f"{v}{u}" for v, u in zip(config, ("w", "a", "b")))
                run(f"fp8_cuda_hm_{name}_s{splits}", k8_hm, v8_hm, splits, cuda=True, order="ordered")
        fp8_decode_cuda.CONFIG = default
        run("fp8_cuda_hm_engine_sdefault", k8_hm, v8_hm, None, cuda=True, order="ordered")
        # The splits merged by the launch's last split block of each request's KV head (MERGE) instead of
        # the merge launch after it: the engine's tiles and two tiles ahead.
        fp8_decode_cuda.MERGE_IN_KERNEL = True
        run("fp8_cuda_hm_engine_merge_sdefault", k8_hm, v8_hm, None, cuda=True, order="ordered")
        fp8_decode_cuda.CONFIG = fp8_decode_cuda.DecodeConfig(2, 2)
        run("fp8_cuda_hm_2w_2a_merge_sdefault", k8_hm, v8_hm, None, cuda=True, order="ordered")
        fp8_decode_cuda.CONFIG, fp8_decode_cuda.MERGE_IN_KERNEL = default, False
        del k8_hm, v8_hm
    if "pages" in groups:
        # The engine's defaults over pages in random order (every earlier kernel figure) and over each
        # request's pages consecutive, as the engine's block pool hands them out and a step reads them: on
        # an H100 the pool's order was 2.4-3.4% faster (fiftieth session).
        k8_hm, v8_hm = head_major(k8), head_major(v8)
        for order in page_orders:
            run(f"bf16_{order}", k_bf, v_bf, None, order=order)
            run(f"fp8_cuda_token_major_{order}", k8, v8, None, cuda=True, order=order)
            run(f"fp8_cuda_head_major_{order}", k8_hm, v8_hm, None, cuda=True, order=order)
        del k8_hm, v8_hm
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
