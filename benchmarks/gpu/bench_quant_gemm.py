"""Quantized GEMMs at decode's shapes on a CUDA GPU (Llama-3.1-8B's linears), as weight-read bandwidth
(TB/s of the weight's bytes, scales included) beside cuBLAS bf16 on the same rows; prints one JSON document.

Per shape and row count: bf16 F.linear; FP8 as the engine ran it before the skinny kernel (per-token
quantization + torch._scaled_mm, row-wise scales) and _scaled_mm alone; the skinny W8A16 kernel; the
tiled W4A16 kernel (kernels/int4_gemm.py) and the skinny W4A16 kernel (kernels/skinny_gemm.py). With
--sweep the skinny kernels are timed over tile configs (a first pass over tile sizes and K splits, a
second over warps and stages for the best three), so the default tiles can be chosen by measurement.
Each timing is a CUDA graph of calls over enough weight copies that L2 cannot hold them (bench_kernels'
time_us). Every case checks its output against the torch reference.

    python benchmarks/gpu/bench_quant_gemm.py --out quant_gemm.json [--sweep] [--rows 1,16]

--fp8-gemm instead times the W8A8 GEMMs at decode batches (--rows, e.g. 32,64,128,256,512): bf16 cuBLAS,
torch._scaled_mm on quantized activations, the per-token quantization alone, and the Triton row-wise FP8
GEMM (kernels/fp8_gemm.py) over its tile configs, the activations quantized beforehand as for cuBLAS.

--int4-rows instead times the INT4 (W4A16, groups of 128) GEMMs at every batch size (--rows, e.g.
1,2,4,8,16,32,64,128,256,2048): bf16 cuBLAS beside the INT4 linears' own dispatch (int4_gemm.w4a16_linear)
and each kernel it can choose (one-row, tensor-core at 16/32/64 activation rows a program, tiled, the whole
weight dequantized for cuBLAS, and that dequantization alone), so its row bounds are set by measurement.

--int4-mma times the tensor-core INT4 GEMV (kernels/w4a16_gemv_cuda.py) against the Triton one-row kernels
the engine ran before it (skinny_gemm.w4a16_skinny at its default tiles) at --rows (1-8), both launched
with PDL inside the graph as the decode step launches them, gate+up also with SiLU-and-multiply in the
store (GemvFusion), with and without its LEAN variant and its main loop unrolled twice (mma, mma_lean,
mma_u2, mma_lean_u2), and sweeps the CUDA kernel's (warps, tiles, stages).

--int8-gemm sweeps the INT8 W8A8 GEMM's tiles at --rows (past the skinny kernel's 16) beside bf16 cuBLAS
and cuBLAS's int8 GEMM (torch._int_mm); --grouped-sweep sweeps GPTQ 8-bit's grouped W8A16 kernel.

--quantize times the per-row activation quantization (FP8, int8) over (BLOCK, num_warps) at --rows for the
K of --shapes.

--int8-rows instead times the INT8 checkpoints' linears (layers/quantization/int8.py: the skinny W8A16
kernel up to 16 rows, the Triton row-wise GEMM on int8 operands past them) beside bf16 cuBLAS, at --rows.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import time_us  # noqa: E402

from tokenmill.kernels import GemvFusion, pdl, quant_reference, w4a16_gemv_cuda  # noqa: E402
from tokenmill.kernels import w4a16_mma as w4a16_mma_module  # noqa: E402
from tokenmill.kernels.fp8_gemm import Fp8GemmConfig, fp8_rowwise_gemm  # noqa: E402
from tokenmill.kernels.fp8_gemm import default_config as fp8_default_config  # noqa: E402
from tokenmill.kernels.fp8_quant import quantize_fp8_per_row  # noqa: E402
from tokenmill.kernels.int4_gemm import dequantize, w4a16_dequant_gemm, w4a16_gemm, w4a16_linear  # noqa: E402
from tokenmill.kernels.skinny_gemm import (  # noqa: E402
    MAX_GEMV_ROWS,
    SkinnyConfig,
    default_config,
    dense_gemv,
    switches,
    w4a16_skinny,
    w8a16_skinny,
)
from tokenmill.kernels.w4a16_mma import default_config as w4a16_mma_config  # noqa: E402
from tokenmill.kernels.w4a16_mma import w4a16_mma  # noqa: E402

SHAPES = {  # name: (N, K) of Llama-3.1-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),  # bf16 in every scheme: only cuBLAS and the dense one-row kernel
}
GROUP = 128
POOL_BYTES = 320 << 20  # weight copies per graph: more than L2 (50 MB) many times over
DEVICE = torch.device("cuda")


def timed(fn, copies: int) -> float:
    calls = itertools.count()
    return time_us(lambda: fn(next(calls) % copies), calls_per_graph=max(copies, 8), replays=30)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6)).item()


def sweep_configs(bits: int, rows: int) -> list[SkinnyConfig]:
    """The first pass: tile sizes and K splits at four warps."""
    if rows == 1:
        block_ns = (8, 16, 32) if bits == 16 else (8, 16, 32, 64)
        block_ks = {4: (512, 1024, 2048, 4096), 8: (512, 1024, 2048, 4096), 16: (128, 256, 512, 1024)}[bits]
        # No K split for FP8 at one row: every linear of the 8B shape fills the SMs without one.
        splits = (1,) if bits == 8 else (1, 2)
        return [SkinnyConfig(n, k, s, 4, 1) for n in block_ns for k in block_ks for s in splits]
    block_ks = (256, 512, 1024) if bits == 4 else (128, 256, 512)
    return [SkinnyConfig(n, k, s, 4, 3) for n in (16, 32, 64) for k in block_ks for s in (1, 2, 4, 8)]


def refinements(base: SkinnyConfig, bits: int, rows: int) -> list[SkinnyConfig]:
    """The second pass around one of the best: warps, and stages (several rows) or the unrolling of
    the K loop (one row)."""
    if rows > 1:
        return [base._replace(num_warps=w, num_stages=st) for w in (2, 4, 8) for st in (2, 3, 4, 5)]
    unrolls = (1, 2) if bits == 4 else (1, 2, 4)
    if bits == 16:
        return [base._replace(num_warps=w, unroll=u) for w in (4, 8) for u in unrolls]
    if bits == 4:  # the packed-fp16 kernel's loads a step ahead too
        return [base._replace(num_warps=w, unroll=u, prefetch=p)
                for w in (2, 4, 8) for u in unrolls for p in (False, True)]  # fmt: skip
    return [base._replace(num_warps=w, unroll=u) for w in (2, 4, 8) for u in unrolls]


def sweep(fn, bits: int, rows: int, copies: int, nbytes: int, budget_s: float) -> dict:
    """Tile sizes and splits first, then refinements of the best three: {config: TB/s}."""
    deadline = time.monotonic() + budget_s
    found: dict[SkinnyConfig, float] = {}

    def measure(config: SkinnyConfig) -> None:
        if config in found or time.monotonic() > deadline:
            return
        try:
            found[config] = nbytes / timed(lambda c, cfg=config: fn(c, cfg), copies) / 1e6
        except Exception as error:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"skip {config}: {type(error).__name__}: {error}", file=sys.stderr)

    for config in sweep_configs(bits, rows):
        measure(config)
    for base in sorted(found, key=found.get, reverse=True)[:3]:
        for config in refinements(base, bits, rows):
            measure(config)
    ranked = sorted(found.items(), key=lambda kv: kv[1], reverse=True)
    return {"best": list(ranked[0][0]), "best_tb_per_s": ranked[0][1], "tried": len(found),
            "top": [[list(c), round(v, 3)] for c, v in ranked[:8]]}  # fmt: skip


SWAP_AB_CONFIGS = [
    Fp8GemmConfig(bm, 16, bk, warps, stages)
    for bm in (64, 128) for bk in (128, 256) for warps in (4, 8) for stages in (3, 4, 5)
    if not (bm == 128 and warps == 4)
]  # fmt: skip


def swap_ab_case(x: torch.Tensor, fp8: list, copies: int, nbytes: int, want: torch.Tensor) -> dict:
    """W8A8 on FP8 tensor cores with the operands swapped: the weight's rows fill the wgmma's M (64 or
    128), the activations (quantized per token, padded to 16 rows) its N; out^T = W x^T. No conversion
    of weight bytes in the loop, unlike the W8A16 kernels; no K split, so a 4096-row weight gives 32-64
    programs. {config: TB/s} and the best, for deciding whether one-row FP8 should go this way."""
    rows, k = x.shape
    x_q, x_scale = quantize_fp8_per_row(x)
    x_pad = torch.zeros(16, k, dtype=x_q.dtype, device=x.device)
    x_pad[:rows] = x_q
    scale_pad = torch.ones(16, 1, dtype=torch.float32, device=x.device)
    scale_pad[:rows] = x_scale.reshape(rows, 1)

    def run(c: int, config: Fp8GemmConfig) -> torch.Tensor:
        w_q, w_scale = fp8[c]
        return fp8_rowwise_gemm(w_q, w_scale, x_pad, scale_pad, None, torch.bfloat16, config)

    found = {}
    for config in SWAP_AB_CONFIGS:
        try:
            err = rel_err(run(0, config)[:, :rows].t(), want)
            found[str(tuple(config))] = (nbytes / timed(lambda c, cfg=config: run(c, cfg), copies) / 1e6, err)
        except Exception as error:  # noqa: BLE001 - a config that does not build is skipped
            print(f"skip swap-AB {config}: {type(error).__name__}: {error}", file=sys.stderr)
    if not found:
        return {}
    best = max(found, key=lambda c: found[c][0])
    return {"best": best, "best_tb_per_s": found[best][0], "rel_err": found[best][1],
            "tb_per_s": {c: round(v[0], 3) for c, v in found.items()}}  # fmt: skip


def int4_weights(n: int, k: int, gen: torch.Generator) -> tuple[int, int, list]:
    """(bytes of one, copies, [(packed words, bf16 scales)] * copies): random 4-bit weights [n, k] in
    symmetric groups of 128 (the online int4 scheme's layout), enough copies to overflow L2."""
    nbytes = n * k // 2 + n * (k // GROUP) * 2
    copies = max(1, math.ceil(POOL_BYTES / nbytes))
    weights = [
        (torch.randint(-(2**31), 2**31 - 1, (n, k // 8), device=DEVICE, dtype=torch.int32, generator=gen),
         (torch.rand(n, k // GROUP, device=DEVICE, generator=gen) * 0.01).to(torch.bfloat16))
        for _ in range(copies)
    ]  # fmt: skip
    return nbytes, copies, weights


def bf16_operands(name: str, rows: int) -> tuple:
    """(n, k, the generator the case goes on drawing from, bytes of one bf16 weight, copies, x [rows, k],
    [bf16 weight] * copies) for shape `name`: the start of every case."""
    n, k = SHAPES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    bf16_bytes = n * k * 2
    copies = max(1, math.ceil(POOL_BYTES / bf16_bytes))
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
    return n, k, gen, bf16_bytes, copies, x, w


def case(name: str, rows: int, do_sweep: tuple[str, ...], budget_s: float) -> dict:
    n, k, gen, bf16_bytes, copies, x, w = bf16_operands(name, rows)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows, "copies_bf16": copies}

    us = timed(lambda c: F.linear(x, w[c]), copies)
    result["bf16_cublas"] = {"us": us, "tb_per_s": bf16_bytes / us / 1e6}
    if rows == 1:
        got = dense_gemv(x, w[0])
        us = timed(lambda c: dense_gemv(x, w[c]), copies)
        config = list(default_config(rows, n, k, 16, DEVICE))
        result["bf16_dense_gemv"] = {"us": us, "tb_per_s": bf16_bytes / us / 1e6, "config": config,
                                     "rel_err": rel_err(got, F.linear(x.float(), w[0].float()))}  # fmt: skip
        if "w16" in do_sweep:
            result["bf16_dense_gemv_sweep"] = sweep(
                lambda c, cfg: dense_gemv(x, w[c], config=cfg), 16, rows, copies, bf16_bytes, budget_s
            )
    if 2 <= rows <= MAX_GEMV_ROWS:  # the one-row kernel over several rows (skinny_gemm.DENSE_ROWS)
        with several_rows():
            got = dense_gemv(x, w[0])
            us = timed(lambda c: dense_gemv(x, w[c]), copies)
        err = rel_err(got, F.linear(x.float(), w[0].float()))
        result["bf16_dense_gemv_rows"] = {"us": us, "tb_per_s": bf16_bytes / us / 1e6, "rel_err": err}
    if name == "lm_head":
        return result

    # FP8, per-row weight scales; each copy its own random weight.
    fp8_bytes = n * k + n * 4
    fp8_copies = max(1, math.ceil(POOL_BYTES / fp8_bytes))
    fp8 = [quantize_fp8_per_row(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=gen))
           for _ in range(fp8_copies)]  # fmt: skip

    def scaled_mm(c: int, x_q=None, x_scale=None) -> torch.Tensor:
        w_q, w_scale = fp8[c]
        if x_q is None:
            x_q, x_scale = quantize_fp8_per_row(x)
        return torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16
        )

    x_q, x_scale = quantize_fp8_per_row(x)
    us = timed(scaled_mm, fp8_copies)
    result["fp8_quant_and_scaled_mm"] = {"us": us, "tb_per_s": fp8_bytes / us / 1e6}
    us = timed(lambda c: scaled_mm(c, x_q, x_scale), fp8_copies)
    result["fp8_scaled_mm_only"] = {"us": us, "tb_per_s": fp8_bytes / us / 1e6}
    want = x.float() @ (fp8[0][0].float() * fp8[0][1]).t()
    got = w8a16_skinny(x, *fp8[0])
    us = timed(lambda c: w8a16_skinny(x, *fp8[c]), fp8_copies)
    config = list(default_config(rows, n, k, 8, DEVICE))
    result["w8a16_skinny"] = {"us": us, "tb_per_s": fp8_bytes / us / 1e6, "config": config,
                              "rel_err": rel_err(got, want)}  # fmt: skip
    if 2 <= rows <= MAX_GEMV_ROWS:  # the one-row kernel over several rows (skinny_gemm.GEMV8_ROWS)
        with several_rows():
            got = w8a16_skinny(x, *fp8[0])
            us = timed(lambda c: w8a16_skinny(x, *fp8[c]), fp8_copies)
        err = rel_err(got, want)
        result["w8a16_gemv_rows"] = {"us": us, "tb_per_s": fp8_bytes / us / 1e6, "rel_err": err}
    if rows <= 16:
        result["fp8_swap_ab"] = swap_ab_case(x, fp8, fp8_copies, fp8_bytes, want)
    if "w8" in do_sweep:
        result["w8a16_skinny_sweep"] = sweep(
            lambda c, cfg: w8a16_skinny(x, *fp8[c], config=cfg), 8, rows, fp8_copies, fp8_bytes, budget_s
        )

    int4_bytes, int4_copies, int4 = int4_weights(n, k, gen)
    want = quant_reference.w4a16_gemm(x.float(), int4[0][0], int4[0][1], None, GROUP)
    got = w4a16_gemm(x, int4[0][0], int4[0][1], None, GROUP)
    us = timed(lambda c: w4a16_gemm(x, int4[c][0], int4[c][1], None, GROUP), int4_copies)
    result["w4a16_tiled"] = {"us": us, "tb_per_s": int4_bytes / us / 1e6, "rel_err": rel_err(got, want)}
    got = w4a16_skinny(x, int4[0][0], int4[0][1], None, GROUP)
    us = timed(lambda c: w4a16_skinny(x, int4[c][0], int4[c][1], None, GROUP), int4_copies)
    config = list(default_config(rows, n, k, 4, DEVICE))
    result["w4a16_skinny"] = {"us": us, "tb_per_s": int4_bytes / us / 1e6, "config": config,
                              "rel_err": rel_err(got, want)}  # fmt: skip
    # The tensor-core kernel (kernels/w4a16_mma.py) over a few tiles.
    got = w4a16_mma(x, int4[0][0], int4[0][1], None, GROUP)
    result["w4a16_mma"] = {"rel_err": rel_err(got, want), "tiles": {}}
    for block_n, warps in ((64, 4), (128, 4), (128, 8), (256, 4), (256, 8)):
        tile = w4a16_mma_config(n, k, DEVICE, block_n, warps)
        us = timed(
            lambda c, cfg=tile: w4a16_mma(x, int4[c][0], int4[c][1], None, GROUP, config=cfg), int4_copies
        )
        result["w4a16_mma"]["tiles"][f"{block_n}x{warps}w_split{tile.split_k}"] = {
            "us": us, "tb_per_s": int4_bytes / us / 1e6
        }  # fmt: skip
    if "w4" in do_sweep:
        result["w4a16_skinny_sweep"] = sweep(
            lambda c, cfg: w4a16_skinny(x, int4[c][0], int4[c][1], None, GROUP, config=cfg),
            4, rows, int4_copies, int4_bytes, budget_s,
        )  # fmt: skip
    return result


def skinny_fp32(*args, **kwargs) -> torch.Tensor:
    """w4a16_skinny with the one-row 16-bit path in fp32 arithmetic (gemv.w4a16_gemv_kernel)."""
    with switches(GEMV4_F16X2=False):
        return w4a16_skinny(*args, **kwargs)


def several_rows():
    """The one-row kernels take up to MAX_GEMV_ROWS rows (skinny_gemm's GEMV*_ROWS candidates) inside."""
    return switches(GEMV4_ROWS=MAX_GEMV_ROWS, GEMV8_ROWS=MAX_GEMV_ROWS, DENSE_ROWS=MAX_GEMV_ROWS)


def packed_rows(*args, **kwargs) -> torch.Tensor:
    """w4a16_skinny with several rows of 16-bit activations in the packed-fp16 kernel (GEMV4_ROWS)."""
    with several_rows():
        return w4a16_skinny(*args, **kwargs)


def int4_rows_case(name: str, rows: int) -> dict:
    """INT4 at `rows` activation rows: bf16 cuBLAS and every INT4 path (module docstring, --int4-rows)."""
    n, k, gen, bf16_bytes, copies, x, w = bf16_operands(name, rows)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    us = timed(lambda c: F.linear(x, w[c]), copies)
    result["bf16_cublas"] = {"us": us, "tb_per_s": bf16_bytes / us / 1e6}
    w.clear()  # the bf16 copies' memory back before the INT4 ones
    int4_bytes, int4_copies, int4 = int4_weights(n, k, gen)
    want = quant_reference.w4a16_gemm(x.float(), int4[0][0], int4[0][1], None, GROUP)
    paths = {"linear": w4a16_linear, "dequant_gemm": w4a16_dequant_gemm}
    if rows <= 16:  # (the tiled kernel, which the engine ran past 16 rows until 2026-12-03, was 7-18x bf16)
        paths["skinny"] = w4a16_skinny
    if rows == 1:  # the one-row kernel in fp32 arithmetic, as before the packed-fp16 one
        paths["skinny_fp32"] = skinny_fp32
    if 2 <= rows <= MAX_GEMV_ROWS:  # the packed-fp16 kernel over several rows (skinny_gemm.GEMV4_ROWS)
        paths["packed_rows"] = packed_rows
        for block_n, warps in ((8, 4), (16, 4), (8, 8)):
            config = SkinnyConfig(block_n, 1024, 1, warps, 1)
            paths[f"packed_rows_{block_n}x{warps}w"] = lambda *a, c=config: packed_rows(*a, config=c)
    # The tensor-core kernel past its engine bound too (the bound is what this measures).
    w4a16_mma_module.MAX_ROWS = max(w4a16_mma_module.MAX_ROWS, rows)
    # (block_n, swap) at 4 warps (8 never won; one dot a plane and loads a step ahead lost, 2026-12-03)
    for block_n, swap in ((64, False), (128, False), (64, True), (128, True)):
        label = f"nat_{block_n}x4w" + "_swap" * swap
        paths[label] = lambda *a, b=block_n, sw=swap: w4a16_mma(
            *a, config=w4a16_mma_config(n, k, DEVICE, b, 4, m=rows), swap=sw
        )
    for label, fn in paths.items():
        try:
            got = fn(x, int4[0][0], int4[0][1], None, GROUP)
            us = timed(lambda c, fn=fn: fn(x, int4[c][0], int4[c][1], None, GROUP), int4_copies)
            bf16_us = result["bf16_cublas"]["us"]
            result[label] = {"us": us, "tb_per_s": int4_bytes / us / 1e6, "x_bf16": bf16_us / us,
                             "rel_err": rel_err(got, want)}  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a path that cannot take this shape
            result[label] = {"error": f"{type(error).__name__}: {error}"}
    us = timed(lambda c: dequantize(int4[c][0], int4[c][1], None, GROUP, k, torch.bfloat16), int4_copies)
    result["dequantize_alone"] = {"us": us, "tb_per_s": (int4_bytes + bf16_bytes) / us / 1e6}
    return result


def int4_mma_case(name: str, rows: int, sweep: bool = True) -> dict:
    """The tensor-core INT4 GEMV against the Triton one-row kernels (module docstring, --int4-mma); without
    `sweep` only at its default tiles."""
    n, k = SHAPES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    int4_bytes, int4_copies, int4 = int4_weights(n, k, gen)
    want = quant_reference.w4a16_gemm(x.float(), int4[0][0], int4[0][1], None, GROUP)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    mma = w4a16_gemv_cuda.w4a16_gemv_mma
    paths = {
        "triton": w4a16_skinny if rows <= MAX_GEMV_ROWS else None,
        "mma": lambda *a, **kw: mma(*a, lean=False, unroll=1, **kw),
        # (LEAN, and UNROLL 2, in the .cu)
        "mma_lean": lambda *a, **kw: mma(*a, lean=True, unroll=1, **kw),
        "mma_u2": lambda *a, **kw: mma(*a, lean=False, unroll=2, **kw),
        "mma_lean_u2": lambda *a, **kw: mma(*a, lean=True, unroll=2, **kw),
    }
    fusions = [None, GemvFusion(silu_mul=True)] if name == "gate_up" else [None]
    tiles = -(-n // 16)
    for warps, tiles_a_block, stages in itertools.product((2, 4, 8), (1, 2), (2, 3, 4, 6, 8)):
        fits = k // 128 >= warps and tiles // tiles_a_block >= 64 and warps * tiles_a_block * stages <= 128
        if sweep and fits:
            config = w4a16_gemv_cuda.MmaConfig(warps, tiles_a_block, stages)
            label = f"mma_{warps}w_{tiles_a_block}t_{stages}s"
            paths[label] = lambda *a, c=config, **kw: mma(*a, config=c, **kw)
    with pdl.in_graphs():
        for fusion in fusions:
            for label, fn in paths.items():
                if fn is None:
                    continue
                key = label + ("_silu" if fusion else "")
                try:
                    got = fn(x, int4[0][0], int4[0][1], None, GROUP, fusion=fusion)
                    call = lambda c, fn=fn, f=fusion: fn(x, int4[c][0], int4[c][1], None, GROUP, fusion=f)  # noqa: E731
                    us = timed(call, int4_copies)
                    entry = {"us": us, "tb_per_s": int4_bytes / us / 1e6}
                    if fusion is None:
                        entry["rel_err"] = rel_err(got, want)
                    result[key] = entry
                except Exception as error:  # noqa: BLE001 - a path that cannot take this shape
                    result[key] = {"error": f"{type(error).__name__}: {error}"}
    return result


def int8_rows_case(name: str, rows: int) -> dict:
    """INT8 at `rows` activation rows (--int8-rows): bf16 cuBLAS beside layers/quantization/int8.py's
    int8_linear as the compressed-tensors INT8 checkpoints run it (activations per token, per tensor, or
    weight-only) and int8_grouped_linear as GPTQ 8-bit ones do (groups of 128 with zero points), each
    against the fp32 product of its weight."""
    from tokenmill.kernels.quant_reference import dequantize_8bit_groups
    from tokenmill.layers.quantization.int8 import int8_grouped_linear, int8_linear

    n, k, gen, bf16_bytes, copies, x, w = bf16_operands(name, rows)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    us = timed(lambda c: F.linear(x, w[c]), copies)
    result["bf16_cublas"] = {"us": us, "tb_per_s": bf16_bytes / us / 1e6}
    w.clear()
    nbytes = n * k + n * 4
    int8_copies = max(1, math.ceil(POOL_BYTES / nbytes))
    weights = []
    for _ in range(int8_copies):
        scale = (torch.rand(n, 1, device=DEVICE, generator=gen) * 0.02 + 0.01) / 127
        q = torch.randint(-128, 128, (n, k), device=DEVICE, dtype=torch.int8, generator=gen)
        weights.append((q, scale))
    want = x.float() @ (weights[0][0].float() * weights[0][1]).t()
    input_scale = x.float().abs().amax().reshape(1) / 127.5
    groups = torch.rand(n, k // GROUP, device=DEVICE, generator=gen) * 0.02 / 127 + 1e-4  # GPTQ 8-bit's
    zeros = torch.zeros(n, k // GROUP, device=DEVICE, dtype=torch.int8)
    grouped = dequantize_8bit_groups(weights[0][0], groups, zeros, GROUP, torch.float32)
    wants = {"gptq8_grouped": x.float() @ grouped.t()}  # (its own scales)
    paths = {
        "gptq8_grouped": lambda c: int8_grouped_linear(x, weights[c][0], groups, zeros, GROUP),
        "int8_token": lambda c: int8_linear(x, *weights[c], None, "token"),
        "int8_tensor": lambda c: int8_linear(x, *weights[c], None, "tensor", input_scale),
        "int8_weight_only": lambda c: int8_linear(x, *weights[c], None, None),
    }
    for label, fn in paths.items():
        try:
            got = fn(0)
            us = timed(fn, int8_copies)
            bf16_us = result["bf16_cublas"]["us"]
            result[label] = {"us": us, "tb_per_s": nbytes / us / 1e6, "x_bf16": bf16_us / us,
                             "rel_err": rel_err(got, wants.get(label, want))}  # fmt: skip
        except Exception as error:  # noqa: BLE001 - a path that cannot take this shape
            result[label] = {"error": f"{type(error).__name__}: {error}"}
    return result


def ranked_configs(configs, call, copies: int, budget_s: float) -> list[tuple]:
    """[(config, us)] fastest first for call(c, config) over `configs` until budget_s runs out; a config
    that does not compile or whose call raises (a wrong result, say) is skipped with a line on stderr."""
    deadline = time.monotonic() + budget_s
    found = {}
    for config in configs:
        if time.monotonic() > deadline:
            break
        try:
            call(0, config)
            found[config] = timed(lambda c, cfg=config: call(c, cfg), copies)
        except Exception as error:  # noqa: BLE001 - the rest go on
            print(f"skip {config}: {type(error).__name__}: {str(error)[:120]}", file=sys.stderr)
    return sorted(found.items(), key=lambda kv: kv[1])


FP8_GEMM_CONFIGS = [
    Fp8GemmConfig(bm, bn, 128, warps, stages)
    for bm in (64, 128) for bn in (64, 128, 256) for warps in (4, 8) for stages in (3, 4, 5)
    if not (bm == 128 and bn == 256 and stages == 5)  # more shared memory than an SM has
]  # fmt: skip


def fp8_gemm_case(name: str, rows: int, budget_s: float) -> dict:
    """One shape at `rows` rows: bf16 cuBLAS, _scaled_mm, the quantization launch, the Triton FP8 GEMM
    at its default tiles and over FP8_GEMM_CONFIGS (us and TB/s of the weight's bytes)."""
    n, k = SHAPES[name]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    bf16_copies = max(1, math.ceil(POOL_BYTES / (n * k * 2)))
    w = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(bf16_copies)]
    result["bf16_cublas_us"] = timed(lambda c: F.linear(x, w[c]), bf16_copies)
    w.clear()  # the bf16 copies go before the FP8 ones are made
    fp8_bytes = n * k + n * 4
    copies = max(1, math.ceil(POOL_BYTES / fp8_bytes))
    fp8 = [quantize_fp8_per_row(torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=gen))
           for _ in range(copies)]  # fmt: skip
    x_q, x_scale = quantize_fp8_per_row(x)
    result["quantize_us"] = timed(lambda c: quantize_fp8_per_row(x), copies)

    def scaled_mm(c: int) -> torch.Tensor:
        w_q, w_scale = fp8[c]
        return torch._scaled_mm(
            x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16
        )

    result["scaled_mm_us"] = timed(scaled_mm, copies)
    want = scaled_mm(0).float()
    # The same with fast accumulation (no promotion of the FP8 tensor cores' partial sums to fp32), and
    # with one scale per tensor (cuBLAS has other kernels for it), each against the row-wise result.
    one = torch.ones((), device=DEVICE)
    for label, scale_a, scale_b, fast in (
        ("scaled_mm_fast", x_scale, None, True),
        ("scaled_mm_tensorwise", one, one, False),
        ("scaled_mm_tensorwise_fast", one, one, True),
    ):  # fmt: skip

        def variant(c: int, scale_a=scale_a, scale_b=scale_b, fast=fast) -> torch.Tensor:
            w_q, w_scale = fp8[c]
            return torch._scaled_mm(
                x_q, w_q.t(), scale_a=scale_a, scale_b=w_scale.view(1, -1) if scale_b is None else scale_b,
                out_dtype=torch.bfloat16, use_fast_accum=fast,
            )  # fmt: skip

        try:
            result[f"{label}_us"] = timed(variant, copies)
            if scale_b is None:
                got = variant(0).float()
                result[f"{label}_rel_err"] = ((got - want).abs().max() / want.abs().max()).item()
        except Exception as error:  # noqa: BLE001 - a mode this torch lacks is reported
            result[f"{label}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    got = fp8_rowwise_gemm(x_q, x_scale, *fp8[0], None, torch.bfloat16).float()
    result["triton_rel_err_vs_scaled_mm"] = ((got - want).abs().max() / want.abs().max()).item()
    result["triton_default"] = list(fp8_default_config(rows, n, k))
    result["triton_default_us"] = timed(
        lambda c: fp8_rowwise_gemm(x_q, x_scale, *fp8[c], None, torch.bfloat16), copies
    )
    ranked = ranked_configs(
        FP8_GEMM_CONFIGS, lambda c, cfg: fp8_rowwise_gemm(x_q, x_scale, *fp8[c], None, torch.bfloat16, cfg),
        copies, budget_s,
    ) or [(fp8_default_config(rows, n, k), None)]  # fmt: skip
    if ranked[0][1] is None:  # no sweep (--budget-s 0): the default tiles stand for the best
        ranked = [(ranked[0][0], result["triton_default_us"])]
    result["triton_best"] = list(ranked[0][0])
    result["triton_best_us"] = ranked[0][1]
    result["triton_top"] = [[list(c), round(us, 2)] for c, us in ranked[:6]]
    result["weight_tb_per_s"] = {
        "bf16": n * k * 2 / result["bf16_cublas_us"] / 1e6,
        "scaled_mm": fp8_bytes / result["scaled_mm_us"] / 1e6,
        "triton_best": fp8_bytes / result["triton_best_us"] / 1e6,
    }
    return result


INT8_GEMM_CONFIGS = FP8_GEMM_CONFIGS + [
    Fp8GemmConfig(128, 256, 64, 8, 4), Fp8GemmConfig(128, 256, 128, 8, 3), Fp8GemmConfig(256, 128, 128, 8, 3),
    Fp8GemmConfig(128, 128, 256, 8, 3), Fp8GemmConfig(64, 256, 128, 8, 4),
]  # fmt: skip


def int8_gemm_case(name: str, rows: int, budget_s: float) -> dict:
    """--int8-gemm: the INT8 W8A8 GEMM past the skinny kernel's rows: bf16 cuBLAS, the per-token
    quantization launch, kernels/fp8_gemm.py's row-wise kernel on int8 operands at its default tiles and
    over INT8_GEMM_CONFIGS, and cuBLAS's int8 GEMM (torch._int_mm, int32 out, then the scales) on the
    [N, K] weight's transposed view and on a [K, N] copy, each checked for exact int32 sums."""
    from tokenmill.kernels.fp8_quant import quantize_int8_per_row

    n, k, gen, _, bf16_copies, x, w = bf16_operands(name, rows)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    result["bf16_cublas_us"] = timed(lambda c: F.linear(x, w[c]), bf16_copies)
    w.clear()
    copies = max(1, math.ceil(POOL_BYTES / (n * k + n * 4)))
    weights = [(torch.randint(-128, 128, (n, k), device=DEVICE, dtype=torch.int8, generator=gen),
                torch.rand(n, 1, device=DEVICE, generator=gen) * 1e-4) for _ in range(copies)]  # fmt: skip
    x_q, x_scale = quantize_int8_per_row(x)
    result["quantize_us"] = timed(lambda c: quantize_int8_per_row(x), copies)
    exact = (x_q.double() @ weights[0][0].double().t()).float() * x_scale * weights[0][1].t()
    got = fp8_rowwise_gemm(x_q, x_scale, *weights[0], None, torch.float32)
    result["triton_rel_err"] = rel_err(got, exact)
    result["triton_default"] = list(fp8_default_config(rows, n, k, int8=True))
    result["triton_default_us"] = timed(
        lambda c: fp8_rowwise_gemm(x_q, x_scale, *weights[c], None, torch.bfloat16), copies
    )
    for label, operand in (
        ("int_mm_view", lambda c: weights[c][0].t()),
        ("int_mm_kn_copy", lambda c, kn=[wq.t().contiguous() for wq, _ in weights[:copies]]: kn[c]),
    ):
        try:
            sums = torch._int_mm(x_q, operand(0))
            result[f"{label}_exact"] = bool(
                torch.equal(sums.double(), x_q.double() @ weights[0][0].double().t())
            )
            result[f"{label}_us"] = timed(lambda c, op=operand: torch._int_mm(x_q, op(c)), copies)
            # with the scales applied as the engine would (one elementwise launch)
            result[f"{label}_scaled_us"] = timed(
                lambda c, op=operand: (torch._int_mm(x_q, op(c)) * x_scale * weights[c][1].t()).to(
                    torch.bfloat16
                ),
                copies,
            )
        except Exception as error:  # noqa: BLE001 - a shape or version cuBLAS refuses is reported
            result[f"{label}_error"] = f"{type(error).__name__}: {str(error)[:200]}"

    def gemm(c: int, config: Fp8GemmConfig) -> torch.Tensor:
        return fp8_rowwise_gemm(x_q, x_scale, *weights[c], None, torch.bfloat16, config)

    ranked = ranked_configs(INT8_GEMM_CONFIGS, gemm, copies, budget_s)
    if ranked:
        result["triton_best"] = list(ranked[0][0])
        result["triton_best_us"] = ranked[0][1]
        result["triton_top"] = [[list(c), round(us, 2)] for c, us in ranked[:6]]
    return result


def grouped_candidates(rows: int) -> list[SkinnyConfig]:
    """The grouped W8A16 kernel's tiles to time at `rows` rows, the likelier first (the budget may end
    the list). Up to 16 rows the default's layout over 32 or 64 columns, K split in two or not; past
    them also the weight's tile as the dot's first operand (swap_ab: wgmma takes it from registers) over
    64 or 128 columns, blocks of rows the default's or 128, and K split in two or four (128 columns a
    program leave the 4,096-wide linears too few programs; a run of 2026-12-06 without splits past 16
    rows found the x tile, re-read by every program, outweighing the weight's)."""
    if rows <= 16:
        return [SkinnyConfig(bn, bk, sk, 4, stages) for bn in (32, 64) for bk in (128, 64)
                for sk in (1, 2) for stages in (3, 4)]  # fmt: skip
    block_ms = (0,) if rows <= 64 else (0, 128) if rows <= 128 else (128, 256)
    swapped = [SkinnyConfig(bn, 128, sk, warps, stages, block_m=bm, swap_ab=True)
               for sk in (2, 4, 1) for bm in block_ms for bn in (128, 64) for warps in (4, 8)
               for stages in (3, 4)]  # fmt: skip
    plain = [SkinnyConfig(bn, 128, sk, 4, stages, block_m=bm)
             for sk in (2, 4, 1) for bm in block_ms for bn in (64, 32) for stages in (3, 4)]  # fmt: skip
    return swapped + plain


def grouped_sweep_case(name: str, rows: int, budget_s: float) -> dict:
    """--grouped-sweep: grouped_w8a16.w8a16_grouped (GPTQ 8-bit, groups of 128 with zero points) at its
    default tiles and over tile sizes, K splits, warps and stages, beside bf16 cuBLAS."""
    from tokenmill.kernels.grouped_w8a16 import w8a16_grouped

    n, k, gen, bf16_bytes, copies, x, w = bf16_operands(name, rows)
    result: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    result["bf16_cublas_us"] = timed(lambda c: F.linear(x, w[c]), copies)
    w.clear()
    nbytes = n * k + n * (k // GROUP) * 5
    copies = max(1, math.ceil(POOL_BYTES / nbytes))
    weights = [(torch.randint(-128, 128, (n, k), device=DEVICE, dtype=torch.int8, generator=gen),
                torch.rand(n, k // GROUP, device=DEVICE, generator=gen) * 1e-4,
                torch.randint(-8, 8, (n, k // GROUP), device=DEVICE, dtype=torch.int8, generator=gen))
               for _ in range(copies)]  # fmt: skip
    want = x.float() @ quant_reference.dequantize_8bit_groups(*weights[0], GROUP, torch.float32).t()
    result["default_us"] = timed(lambda c: w8a16_grouped(x, *weights[c], GROUP), copies)
    result["default_rel_err"] = rel_err(w8a16_grouped(x, *weights[0], GROUP), want)
    candidates = grouped_candidates(rows)

    def checked(c: int, config: SkinnyConfig) -> torch.Tensor:
        got = w8a16_grouped(x, *weights[c], GROUP, config=config)
        # (Checked on the first call only: rel_err's .item() would end the timing's graph capture.)
        if c == 0 and not torch.cuda.is_current_stream_capturing() and rel_err(got, want) > 2e-2:
            raise ValueError(f"rel_err {rel_err(got, want):.3g}")
        return got

    ranked = ranked_configs(candidates, checked, copies, budget_s)
    if ranked:
        result["best"] = list(ranked[0][0])
        result["best_us"] = ranked[0][1]
        result["best_x_bf16"] = result["bf16_cublas_us"] / ranked[0][1]
        result["top"] = [[list(c), round(us, 2)] for c, us in ranked[:6]]
        result["timed"] = f"{len(ranked)} of {len(candidates)}"
    result["default_x_bf16"] = result["bf16_cublas_us"] / result["default_us"]
    return result


QUANTIZE_TILES = [
    (4096, 4),
    (4096, 8),
    (4096, 16),
    (8192, 8),
    (8192, 16),
    (16384, 16),
    (16384, 32),
    (2048, 4),
]


def quantize_case(columns: int, rows: int) -> dict:
    """--quantize: kernels/fp8_quant.py's per-row activation quantization (FP8 and int8) at its default
    (BLOCK, num_warps) and over QUANTIZE_TILES, as GB/s of the bf16 read and the 8-bit write."""
    from tokenmill.kernels import fp8_quant

    nbytes = rows * columns * 3
    copies = max(1, math.ceil(POOL_BYTES / (rows * columns * 2)))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    xs = [
        torch.randn(rows, columns, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(copies)
    ]
    result: dict = {"columns": columns, "rows": rows}
    for dtype, label in ((torch.float8_e4m3fn, "fp8"), (torch.int8, "int8")):
        us = timed(lambda c, dt=dtype: fp8_quant._quantize_per_row(xs[c], dt), copies)
        result[f"{label}_default_us"] = us
        result[f"{label}_default_gb_s"] = nbytes / us / 1e3
        want = fp8_quant._quantize_per_row(xs[0], dtype)
        tiles = {}
        for tile in QUANTIZE_TILES:
            try:
                got = fp8_quant._quantize_per_row(xs[0], dtype, tiles=tile)
                if not (
                    torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                    and torch.equal(got[1], want[1])
                ):
                    raise ValueError("differs from the default tiles")
                tiles[f"{tile[0]}x{tile[1]}"] = round(
                    timed(
                        lambda c, dt=dtype, t=tile: fp8_quant._quantize_per_row(xs[c], dt, tiles=t), copies
                    ),
                    2,
                )
            except Exception as error:  # noqa: BLE001 - reported, the rest go on
                tiles[f"{tile[0]}x{tile[1]}"] = f"{type(error).__name__}: {str(error)[:100]}"
        result[f"{label}_tiles_us"] = tiles
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-rows", default="1", help="row counts that get the tile sweep")
    parser.add_argument("--sweep-kernels", default="w8,w4", help="of w16 (dense bf16), w8, w4")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down", help=f"of {','.join(SHAPES)}")
    parser.add_argument("--fp8-gemm", action="store_true", help="the W8A8 GEMMs at decode batches")
    parser.add_argument("--int4-rows", action="store_true", help="the INT4 GEMMs at every batch size")
    parser.add_argument("--int8-rows", action="store_true", help="the INT8 checkpoints' linears by rows")
    parser.add_argument("--int4-mma", action="store_true", help="the tensor-core INT4 GEMV against Triton")
    parser.add_argument("--no-tile-sweep", action="store_true", help="--int4-mma at its default tiles only")
    parser.add_argument("--int8-gemm", action="store_true", help="the INT8 W8A8 GEMM past 16 rows, swept")
    parser.add_argument("--grouped-sweep", action="store_true", help="GPTQ 8-bit's grouped W8A16, swept")
    parser.add_argument(
        "--quantize", action="store_true", help="the per-row activation quantization, by tiles"
    )
    parser.add_argument("--budget-s", type=float, default=300, help="all the sweeps together")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    sweep_rows = args.sweep_rows.split(",") if args.sweep else []
    kernels = tuple(args.sweep_kernels.split(","))
    # The budget is shared evenly by the (shape, rows, kernel) sweeps.
    shapes = args.shapes.split(",")
    share = args.budget_s / max(1, len(shapes) * len(sweep_rows) * len(kernels))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    row_counts = [int(r) for r in args.rows.split(",")]
    if args.int4_rows:
        cases = [(n, r, lambda n=n, r=r: int4_rows_case(n, r)) for r in row_counts for n in shapes]
    elif args.int4_mma:
        sweep = not args.no_tile_sweep
        cases = [(n, r, lambda n=n, r=r: int4_mma_case(n, r, sweep)) for r in row_counts for n in shapes]
    elif args.int8_rows:
        cases = [(n, r, lambda n=n, r=r: int8_rows_case(n, r)) for r in row_counts for n in shapes]
    elif args.quantize:
        widths = sorted({SHAPES[n][1] for n in shapes})
        cases = [(str(c), r, lambda c=c, r=r: quantize_case(c, r)) for r in row_counts for c in widths]
    elif args.int8_gemm or args.grouped_sweep:
        budget = args.budget_s / len(row_counts) / len(shapes)
        body = int8_gemm_case if args.int8_gemm else grouped_sweep_case
        cases = [(n, r, lambda n=n, r=r, f=body: f(n, r, budget)) for r in row_counts for n in shapes]
    elif args.fp8_gemm:
        budget = args.budget_s / len(row_counts) / len(shapes)
        cases = [(n, r, lambda n=n, r=r: fp8_gemm_case(n, r, budget)) for r in row_counts for n in shapes]
    else:
        cases = [
            (n, r, lambda n=n, r=r: case(n, r, kernels if str(r) in sweep_rows else (), share))
            for r in row_counts
            for n in shapes
        ]
    for name, rows, body in cases:
        try:
            report["cases"].append(body())
        except Exception as error:  # noqa: BLE001 - one broken case must not end the run
            report["cases"].append({"shape": name, "rows": rows, "error": f"{type(error).__name__}: {error}"})
        print(json.dumps(report["cases"][-1]), file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
