"""Decode attention variants at batch 16 x 32k context (or --case B x L: 256 x 544 is a throughput
run's decode), Llama-3.1-8B's layout, us per layer, against the kernel as it is: the A/B behind
docs/performance.md's FP8 KV entries, rerunnable.

The variants are built at run time from tokenmill/kernels/attention.py's own text by a few edits
(`EDITS`; an edit that no longer matches stops the run, so the A/B is always against today's kernel):
  v_t       V stored transposed in each page ([block, head, dim, slot]: keys contiguous for P.V)
  intcvt    e4m3 -> fp16 by integer ops (PRMT/LOP3, the 2^8 folded into the scales), not F2FP
  trans     keys as the MMA's M dimension: S^T = K Q^T and O^T = V^T P^T, so that 128 keys fill a
            wgmma tile; with fp8mma both products on FP8 tensor cores (the query quantized per row and
            the probabilities to e4m3, as FlashAttention-3's FP8 path does: an approximation, whose
            error against the reference is printed beside its time)
plus the page layout (token-major as the engine allocates it, or head-major, which the kernels
already take through strides) and launch options (tiles, splits, maxnreg). Each timing is a CUDA
graph of launches over two copies of the pool (bench_kernels.time_us).

    python benchmarks/gpu/ab_attention.py [--groups base,layout,convert,occupancy,trans,tiles]
                                          [--case 16x32768] [--out FILE]
(tiles: the FP8 cache's tile, warps and stages without KV splits, for many short requests)
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import time_us  # noqa: E402

from tokenmill.kernels import attention, reference  # noqa: E402

BATCH, CONTEXT, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 32768, 32, 8, 128, 16

_HELPERS = '''
@triton.jit
def _fp8_to_fp16_div256(x):
    """e4m3 bytes to fp16 holding value / 256, by integer ops only."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 lo, hi, t;
        prmt.b32 lo, $2, 0, 0x1404;
        prmt.b32 hi, $2, 0, 0x3424;
        shr.b32 t, lo, 1;
        and.b32 t, t, 0x3F803F80;
        and.b32 lo, lo, 0x80008000;
        or.b32 $0, t, lo;
        shr.b32 t, hi, 1;
        and.b32 t, t, 0x3F803F80;
        and.b32 hi, hi, 0x80008000;
        or.b32 $1, t, hi;
        }
        """,
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4,
    )


@triton.jit
def _v_t_keys(page, k_pos, v_head_offset, stride_cache_block, KV_BLOCK_SIZE: tl.constexpr):
    """Each key's offset at dim 0 in a V cache stored [block, head, dim, slot]; dim d is d * slots on."""
    base = tl.multiple_of(page.to(tl.int64) * stride_cache_block + v_head_offset, KV_BLOCK_SIZE)
    return base + tl.max_contiguous(tl.multiple_of(k_pos % KV_BLOCK_SIZE, KV_BLOCK_SIZE), KV_BLOCK_SIZE)


@triton.jit
def _attend_t(accT, m_i, l_i, qT, q_pos, k_cache, v_cache, block_table, kv_head_offset, v_head_offset,
              kv_lo, kv_hi, scale_vec, stride_cache_block, stride_cache_slot, dims,
              KV_BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
              V_T: tl.constexpr, FP8MMA: tl.constexpr):
    """_attend_kv_range with keys as the MMA's M dimension: accT [dims, rows]."""
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + offs_n
        key_ok = k_pos < kv_hi
        if CAUSAL_MASK:
            page = tl.load(block_table + k_pos // KV_BLOCK_SIZE, mask=key_ok, other=0)
        else:
            page = tl.load(block_table + k_pos // KV_BLOCK_SIZE)
        slot_offset = (page.to(tl.int64) * stride_cache_block + (k_pos % KV_BLOCK_SIZE) * stride_cache_slot
                       + kv_head_offset)
        if V_T:
            v_keys = _v_t_keys(page, k_pos, v_head_offset, stride_cache_block, KV_BLOCK_SIZE)
            v_off = v_keys[None, :] + (dims * KV_BLOCK_SIZE)[:, None]
        else:
            v_off = slot_offset[None, :] + dims[:, None]
        if CAUSAL_MASK:
            k = tl.load(k_cache + slot_offset[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_cache + slot_offset[:, None] + dims[None, :])
        if FP8MMA:
            sT = tl.dot(k, qT)
        else:
            sT = tl.dot(k.to(tl.float16), qT)
        sT = sT * scale_vec[None, :]
        if CAUSAL_MASK:
            visible = (k_pos[:, None] <= q_pos[None, :]) & key_ok[:, None]
            sT = tl.where(visible, sT, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sT, 0))
        p = tl.exp2(sT - m_new[None, :])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        if CAUSAL_MASK:
            vT = tl.load(v_cache + v_off, mask=key_ok[None, :], other=0.0)
        else:
            vT = tl.load(v_cache + v_off)
        if FP8MMA:
            accT = accT * alpha[None, :] + tl.dot(vT, p.to(vT.dtype))
        else:
            accT = accT * alpha[None, :] + tl.dot(vT.to(tl.float16), p.to(tl.float16))
        m_i = m_new
    return accT, m_i, l_i


@triton.jit
def _attend_kv_range('''

# The edits are code text, laid out as the code they write.
# fmt: off
_RANGE_CALL = '''    acc, m_i, l_i = _attend_kv_range(
        acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, {lo}, {hi},
        qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,
        KV_BLOCK_SIZE, BLOCK_N, {causal}, HEAD_DIM != HEAD_DIM_PAD, PRECISION,
    )  # fmt: skip
'''

# (old text, new text) pairs applied to attention.py, each of which must match exactly once.
EDITS = [
    ("@triton.jit\ndef _attend_kv_range(", _HELPERS),
    ("    PRECISION: tl.constexpr,\n):\n    \"\"\"Online-softmax",
     "    PRECISION: tl.constexpr,\n    v_head_offset=0,\n    V_T: tl.constexpr = False,\n"
     "    INTCVT: tl.constexpr = False,\n):\n    \"\"\"Online-softmax"),
    ("        k = tl.load(k_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)\n"
     "        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale",
     "        if INTCVT:\n"
     "            k = _fp8_to_fp16_div256(tl.load(k_cache.to(tl.pointer_type(tl.uint8)) + kv_offsets,\n"
     "                                            mask=kv_mask, other=None if kv_mask is None else 0))\n"
     "            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (qk_scale * 256.0)\n"
     "        else:\n"
     "            k = tl.load(k_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)\n"
     "            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale"),
    ("        v = tl.load(v_cache + kv_offsets, mask=kv_mask, other=kv_other).to(q.dtype)",
     "        if V_T:\n"
     "            v_keys = _v_t_keys(page, k_pos, v_head_offset, stride_cache_block, KV_BLOCK_SIZE)\n"
     "            v_off = v_keys[:, None] + (dims * KV_BLOCK_SIZE)[None, :]\n"
     "        else:\n"
     "            v_off = kv_offsets\n"
     "        if INTCVT:\n"
     "            v = _fp8_to_fp16_div256(tl.load(v_cache.to(tl.pointer_type(tl.uint8)) + v_off,\n"
     "                                            mask=kv_mask, other=None if kv_mask is None else 0))\n"
     "        else:\n"
     "            v = tl.load(v_cache + v_off, mask=kv_mask, other=kv_other).to(q.dtype)"),
    ("    PDL: tl.constexpr = False,\n):",
     "    PDL: tl.constexpr = False,\n    V_T: tl.constexpr = False,\n    INTCVT: tl.constexpr = False,\n"
     "    TRANS: tl.constexpr = False,\n    FP8MMA: tl.constexpr = False,\n):"),
    ("        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)\n",
     "        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)\n"
     "    q_rowscale = tl.full([BLOCK_M], 1.0, tl.float32)\n"
     "    if FP8MMA:\n"
     "        q_rowscale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30) / 448.0\n"
     "        q = (q.to(tl.float32) / q_rowscale[:, None]).to(k_cache.dtype.element_ty)\n"),
    (_RANGE_CALL.format(lo="kv_lo", hi="unmasked_hi", causal="False")
     + _RANGE_CALL.format(lo="unmasked_hi", hi="kv_hi", causal="True"),
     "    v_head_offset = kv_head.to(tl.int64) * HEAD_DIM * KV_BLOCK_SIZE\n"
     "    if TRANS:\n"
     "        accT = tl.zeros([HEAD_DIM_PAD, BLOCK_M], dtype=tl.float32)\n"
     "        qT = tl.trans(q)\n"
     "        scale_vec = q_rowscale * qk_scale\n"
     "        accT, m_i, l_i = _attend_t(accT, m_i, l_i, qT, q_pos, k_cache, v_cache, block_table,\n"
     "            kv_head_offset, v_head_offset, kv_lo, unmasked_hi, scale_vec, stride_cache_block,\n"
     "            stride_cache_slot, dims, KV_BLOCK_SIZE, BLOCK_N, False, V_T, FP8MMA)\n"
     "        accT, m_i, l_i = _attend_t(accT, m_i, l_i, qT, q_pos, k_cache, v_cache, block_table,\n"
     "            kv_head_offset, v_head_offset, unmasked_hi, kv_hi, scale_vec, stride_cache_block,\n"
     "            stride_cache_slot, dims, KV_BLOCK_SIZE, BLOCK_N, True, V_T, FP8MMA)\n"
     "        acc = tl.trans(accT)\n"
     "    else:\n"
     "        acc, m_i, l_i = _attend_kv_range(\n"
     "            acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, kv_lo,\n"
     "            unmasked_hi, qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok,\n"
     "            KV_BLOCK_SIZE, BLOCK_N, False, HEAD_DIM != HEAD_DIM_PAD, PRECISION, v_head_offset, V_T,\n"
     "            INTCVT)\n"
     "        acc, m_i, l_i = _attend_kv_range(\n"
     "            acc, m_i, l_i, q, q_pos, k_cache, v_cache, block_table, kv_head_offset, unmasked_hi,\n"
     "            kv_hi, qk_scale, stride_cache_block, stride_cache_slot, dims, dim_ok, KV_BLOCK_SIZE,\n"
     "            BLOCK_N, True, HEAD_DIM != HEAD_DIM_PAD, PRECISION, v_head_offset, V_T, INTCVT)\n"),
    ("    result = acc * (v_scale / l_safe)[:, None]",
     "    result = acc * ((v_scale * 256.0 if INTCVT else v_scale) / l_safe)[:, None]"),
    ("**pdl.launch_args(query),\n        )  # fmt: skip\n\n    small",
     "**pdl.launch_args(query), **EXTRA,\n        )  # fmt: skip\n\n    small"),
    ("    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:",
     "    if k_cache.stride(3) != 1:"),
    ("        config = decode_config(group, query.element_size(), k_cache.element_size(), programs_per_sm)",
     "        config = CONFIG or decode_config(group, query.element_size(), k_cache.element_size(),\n"
     "                                         programs_per_sm)"),
    ("class TileConfig(NamedTuple):", "EXTRA = {}\nCONFIG = None\n\n\nclass TileConfig(NamedTuple):"),
]
# fmt: on


def build_variants():
    """attention.py with EDITS applied, imported as a module of its own."""
    text = (ROOT / "tokenmill" / "kernels" / "attention.py").read_text()
    for old, new in EDITS:
        if text.count(old) != 1:
            raise SystemExit(f"attention.py changed: {old[:60]!r} found {text.count(old)} times")
        text = text.replace(old, new)
    path = Path(tempfile.mkdtemp()) / "attention_variants.py"
    path.write_text(text)  # Triton reads a kernel's source from its file
    spec = importlib.util.spec_from_file_location("attention_variants", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    global BATCH, CONTEXT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="base,layout,convert,occupancy,trans")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--case", default="16x32768", help="requests x context (a multiple of 16)")
    args = parser.parse_args()
    BATCH, CONTEXT = (int(v) for v in args.case.split("x"))
    groups = set(args.groups.split(","))
    variants = build_variants()
    dev = "cuda"
    blocks_per_seq = CONTEXT // BLOCK
    copies = 2
    num_blocks = copies * BATCH * blocks_per_seq
    torch.manual_seed(0)
    k_bf = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_bf = torch.randn_like(k_bf)
    k8, v8 = k_bf.to(torch.float8_e4m3fn), v_bf.to(torch.float8_e4m3fn)
    v8_t = v8.permute(0, 2, 3, 1).contiguous()  # [block, head, dim, slot]

    def head_major(t: torch.Tensor) -> torch.Tensor:
        return t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)

    pages = torch.randperm(num_blocks, device=dev).to(torch.int32).view(copies, BATCH, blocks_per_seq)
    seq_lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32, device=dev)
    starts = torch.arange(BATCH + 1, dtype=torch.int32, device=dev)
    query = torch.randn(BATCH, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    want = {
        dtype: reference.paged_attention(query, k, v, pages[0], seq_lens, starts, scale).float()
        for dtype, k, v in ((torch.bfloat16, k_bf, v_bf), (torch.float8_e4m3fn, k8, v8))
    }
    results: dict[str, dict] = {}

    def run(name, module, k_cache, v_cache, splits, extra=None, config=None) -> None:
        variants.EXTRA, variants.CONFIG = extra or {}, config
        calls = itertools.count()

        def step() -> None:
            module.paged_attention(
                query, k_cache, v_cache, pages[next(calls) % copies], seq_lens, starts, scale, out,
                max_query_len=1, max_seq_len=CONTEXT, num_kv_splits=splits,
            )  # fmt: skip

        try:
            got = module.paged_attention(
                query, k_cache, v_cache, pages[0], seq_lens, starts, scale, max_query_len=1,
                max_seq_len=CONTEXT, num_kv_splits=splits,
            ).float()  # fmt: skip
            ref = want[k_cache.dtype]
            us = time_us(step, 8, replays=30)
            results[name] = {
                "us": us,
                "kv_tb_per_s": 2 * BATCH * CONTEXT * KV_HEADS * HEAD_DIM * k_cache.element_size() / us / 1e6,
                "max_abs_err": (got - ref).abs().max().item(),
                "rel_rms_err": ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item(),
            }
        except Exception as error:  # noqa: BLE001 - a variant that does not build is reported
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        print(name, json.dumps(results[name]), flush=True)

    tile = attention.TileConfig
    if "base" in groups:
        for splits in (2, 4):
            run(f"bf16_s{splits}", attention, k_bf, v_bf, splits)
            run(f"fp8_s{splits}", attention, k8, v8, splits)
    if "layout" in groups:
        for splits in (2, 4):
            run(f"bf16_head_major_s{splits}", attention, head_major(k_bf), head_major(v_bf), splits)
            run(f"fp8_head_major_s{splits}", attention, head_major(k8), head_major(v8), splits)
            run(f"fp8_v_t_s{splits}", variants, k8, v8_t, splits, {"V_T": True})
    if "convert" in groups:
        run("fp8_intcvt_s2", variants, k8, v8, 2, {"INTCVT": True})
    if "occupancy" in groups:
        for extra, config, splits in (
            ({"maxnreg": 168}, None, (4, 8)), ({"maxnreg": 128}, None, (4, 8)),
            ({}, tile(16, 64, 4, 2), (2, 8)), ({}, tile(16, 32, 4, 3), (4, 16)),
            ({}, tile(16, 256, 4, 3), (2,)),
        ):  # fmt: skip
            for n in splits:
                label = f"{tuple(config) if config else ''}{extra or ''}"
                run(f"fp8_{label}_s{n}", variants, k8, v8, n, extra, config)
    if "tiles" in groups:
        for splits in (1, 2):
            run(f"bf16_s{splits}", attention, k_bf, v_bf, splits)
            run(f"fp8_s{splits}", attention, k8, v8, splits)
        for extra, config in (
            ({}, tile(16, 128, 4, 2)), ({}, tile(16, 128, 8, 3)), ({"maxnreg": 128}, None),
            ({}, tile(16, 64, 4, 2)), ({}, tile(16, 64, 4, 3)), ({}, tile(16, 64, 4, 4)),
            ({}, tile(16, 64, 2, 3)), ({}, tile(16, 32, 4, 3)), ({}, tile(16, 32, 2, 3)),
            ({"INTCVT": True}, None), ({"INTCVT": True}, tile(16, 64, 4, 3)),
        ):  # fmt: skip
            label = f"{tuple(config) if config else ''}{extra or ''}"
            run(f"fp8_{label}_s1", variants, k8, v8, 1, extra, config)
        # V transposed in the page: the P.V operand's pairs of keys are adjacent bytes, so its shared-
        # memory reads are not byte by byte (sm_90 SASS of the 64-key, two-warp loop: 188 -> 45 LDS,
        # 28.4 -> 19.0 warp instructions a key; benchmarks/sass_loop.py's way of counting).
        for config in (tile(16, 64, 2, 3), tile(16, 128, 4, 3)):
            run(f"fp8_v_t_{tuple(config)}_s1", variants, k8, v8_t, 1, {"V_T": True}, config)
    if "trans" in groups:
        for splits in (2, 4):
            run(f"fp8_trans_fp8mma_s{splits}", variants, k8, v8, splits, {"TRANS": True, "FP8MMA": True})
        run("fp8_trans_fp8mma_v_t_s2", variants, k8, v8_t, 2, {"TRANS": True, "FP8MMA": True, "V_T": True})
        run("fp8_trans_fp16_s2", variants, k8, v8, 2, {"TRANS": True})
        wide = tile(16, 256, 4, 3)
        run("fp8_trans_fp8mma_256_s2", variants, k8, v8, 2, {"TRANS": True, "FP8MMA": True}, wide)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
