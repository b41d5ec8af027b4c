"""Microbenchmark of tokenmill's Triton kernels on a CUDA GPU; prints one JSON document.

Decode attention (Llama-3.1-8B head layout, bf16, KV block size 16) is reported as KV-read bandwidth,
against torch SDPA over the same KV laid out contiguously; prefill attention of one 8192-token sequence
as TFLOP/s against SDPA's flash and cuDNN backends; the small kernels as bandwidth. Every timing is a
CUDA graph of several calls, replayed after a warm-up, median of many replays (CUDA events). A case
that fails is reported with its error and the run goes on.

    python benchmarks/gpu/bench_kernels.py --out kernels.json [--sweep]
    python benchmarks/gpu/bench_kernels.py --decode-only --decode-cases 16x32768 --kv-dtype fp8 --sweep

--kv-dtype fp8 stores the decode cases' KV cache in e4m3 (bf16 queries, as the engine runs an FP8 cache),
and the sweep then also tries the tiles and warp counts an FP8 cache may want.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import traceback
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenmill.kernels import activation, attention, kv_cache, norm, reference, rotary, split_kv  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, INTERMEDIATE = 4096, 14336
DTYPE = torch.bfloat16
DEVICE = torch.device("cuda")
# Enough distinct KV per graph that repeated calls cannot be served from the 50 MB L2 cache.
MIN_KV_POOL_BYTES = 256 << 20
DECODE_SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
DECODE_CONFIG_SWEEP = (
    attention.TileConfig(16, 32, 4, 3),
    attention.TileConfig(16, 64, 4, 2),
    attention.TileConfig(16, 64, 4, 4),
    attention.TileConfig(16, 128, 4, 3),
    attention.TileConfig(16, 64, 8, 3),
    # Fewer warps: with 16 query rows and 4 warps each key tile is split across warps, so the row max and
    # the probabilities cross warps (shared memory and barriers) every step; one or two warps keep
    # them in registers (seen in the FP8 kernel's SASS: 2 barriers and ~200 shared loads a tile).
    attention.TileConfig(16, 64, 1, 3),
    attention.TileConfig(16, 128, 2, 3),
    attention.TileConfig(16, 128, 1, 3),
    attention.TileConfig(16, 256, 4, 3),
)
PREFILL_CONFIG_SWEEP = (
    attention.TileConfig(128, 64, 8, 3),
    attention.TileConfig(128, 128, 8, 2),
    attention.TileConfig(64, 64, 4, 3),
    attention.TileConfig(128, 32, 4, 3),
)


def time_us(fn: Callable[[], object], calls_per_graph: int, replays: int, warmup: int = 3) -> float:
    """Median microseconds per call: `calls_per_graph` calls captured in one CUDA graph, so launch gaps
    are what a graphed model step would see; each replay is timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls_per_graph)
    return statistics.median(times)


@contextmanager
def tile_config(name: str, config: attention.TileConfig):
    """Force one attention launch config for a sweep: `name` is decode_config or prefill_config."""
    with mock.patch.object(attention, name, lambda *args: config):
        yield


def run_case(results: list[dict], case: dict, body: Callable[[], dict]) -> None:
    try:
        case.update(body())
    except Exception as error:  # noqa: BLE001 - one broken case must not end the run
        case["error"] = f"{type(error).__name__}: {error}"
        case["traceback"] = traceback.format_exc(limit=3)
        with suppress(Exception):
            torch.cuda.synchronize()
    results.append(case)
    print(json.dumps(case), file=sys.stderr, flush=True)


def decode_case(batch: int, context: int, sweep: bool, kv_dtype: torch.dtype = DTYPE) -> dict:
    blocks_per_seq = math.ceil(context / KV_BLOCK_SIZE)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * kv_dtype.itemsize
    copies = max(1, math.ceil(MIN_KV_POOL_BYTES / kv_bytes))
    num_blocks = copies * batch * blocks_per_seq
    shape = (num_blocks, KV_BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE).to(kv_dtype)
    v_cache = torch.randn(shape, device=DEVICE, dtype=DTYPE).to(kv_dtype)
    # Each copy's requests own scattered pages, as in a long-running server.
    pages = torch.randperm(num_blocks, device=DEVICE, dtype=torch.int64).to(torch.int32)
    block_tables = pages.view(copies, batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    calls_per_graph = max(copies, 8)

    def measure(num_kv_splits: int | None) -> float:
        calls = itertools.count()

        def step() -> None:
            tables = block_tables[next(calls) % copies]
            attention.paged_attention(
                query, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, out,
                max_query_len=1, max_seq_len=context, num_kv_splits=num_kv_splits,
            )  # fmt: skip

        return time_us(step, calls_per_graph, replays=50)

    splits = split_kv.default_num_kv_splits(batch, NUM_KV_HEADS, context, query.device)
    us = measure(None)
    result = {"us": us, "kv_tb_per_s": kv_bytes / us / 1e6, "num_kv_splits": splits, "kv_pool_copies": copies}
    want = reference.paged_attention(
        query, k_cache, v_cache, block_tables[0], seq_lens, query_start_loc, scale
    )
    got = attention.paged_attention(
        query, k_cache, v_cache, block_tables[0], seq_lens, query_start_loc, scale, max_query_len=1
    )
    result["max_abs_err_vs_reference"] = (got.float() - want.float()).abs().max().item()

    # The same attention by SDPA over contiguous bf16 KV (no paging), the bar from GPU_FACTS.md.
    sdpa_bytes = kv_bytes * DTYPE.itemsize // kv_dtype.itemsize
    sdpa_copies = max(1, math.ceil(MIN_KV_POOL_BYTES / sdpa_bytes))
    k = torch.randn(sdpa_copies, batch, NUM_KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v = torch.randn_like(k)
    q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)
    sdpa_calls = itertools.count()

    def sdpa_step() -> None:
        copy = next(sdpa_calls) % sdpa_copies
        F.scaled_dot_product_attention(q, k[copy], v[copy], enable_gqa=True)

    sdpa_us = time_us(sdpa_step, max(sdpa_copies, 8), replays=50)
    result.update(sdpa_contiguous_us=sdpa_us, sdpa_contiguous_kv_tb_per_s=sdpa_bytes / sdpa_us / 1e6)
    if sweep:
        result["us_by_num_kv_splits"] = {str(n): measure(n) for n in DECODE_SPLIT_SWEEP}
        by_config = {}
        for config in DECODE_CONFIG_SWEEP:
            with tile_config("decode_config", config):
                by_config[str(tuple(config))] = measure(None)
        result["us_by_tile_config(block_m,block_n,warps,stages)"] = by_config
    return result


def causal_flops(query_len: int, seq_len: int) -> float:
    """QK^T and PV FLOPs of the keys each query sees (the masked half is not counted)."""
    context_len = seq_len - query_len
    pairs = query_len * context_len + query_len * (query_len + 1) // 2
    return 4.0 * pairs * NUM_HEADS * HEAD_DIM


def prefill_case(query_len: int, context_len: int, sweep: bool) -> dict:
    seq_len = context_len + query_len
    blocks = math.ceil(seq_len / KV_BLOCK_SIZE)
    k_cache = torch.randn(blocks, KV_BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(blocks, device=DEVICE).to(torch.int32)[None]
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, query_len], dtype=torch.int32, device=DEVICE)
    query = torch.randn(query_len, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    flops = causal_flops(query_len, seq_len)

    def step() -> None:
        attention.paged_attention(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
            max_query_len=query_len, max_seq_len=seq_len,
        )  # fmt: skip

    us = time_us(step, calls_per_graph=3, replays=20)
    result = {"us": us, "tflop_per_s": flops / us / 1e6}
    if sweep:
        by_config = {}
        for config in PREFILL_CONFIG_SWEEP:
            with tile_config("prefill_config", config):
                try:
                    by_config[str(tuple(config))] = flops / time_us(step, 3, 20) / 1e6
                except Exception as error:  # noqa: BLE001 - e.g. out of shared memory
                    by_config[str(tuple(config))] = f"{type(error).__name__}: {error}"
        result["tflop_per_s_by_tile_config(block_m,block_n,warps,stages)"] = by_config
    if context_len:
        return result

    # SDPA over the same tokens, with KV heads expanded so every backend accepts it (same FLOPs).
    keys = k_cache[block_tables[0].long()].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
    values = v_cache[block_tables[0].long()].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:seq_len]
    q = query.transpose(0, 1)[None]
    k = keys.transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 0)[None].contiguous()
    v = values.transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 0)[None].contiguous()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # noqa: E731
                sdpa_us = time_us(sdpa, calls_per_graph=3, replays=20)
                expected = sdpa()[0].transpose(0, 1)
            result[f"sdpa_{name}_tflop_per_s"] = flops / sdpa_us / 1e6
            result[f"max_abs_err_vs_sdpa_{name}"] = (out.float() - expected.float()).abs().max().item()
        except Exception as error:  # noqa: BLE001 - a backend this build lacks is a result, not a crash
            result[f"sdpa_{name}_error"] = f"{type(error).__name__}: {error}"
    return result


def elementwise_cases(num_tokens: int) -> dict[str, Callable[[], dict]]:
    """name -> body; bytes counted are the reads and writes each kernel must make."""
    gen = dict(device=DEVICE, dtype=DTYPE)
    x, residual = torch.randn(num_tokens, HIDDEN, **gen), torch.randn(num_tokens, HIDDEN, **gen)
    weight = torch.randn(HIDDEN, **gen)
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, **gen)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, **gen)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, **gen)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    cos_sin_cache = torch.randn(8192, HEAD_DIM, device=DEVICE)
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, **gen)
    num_blocks = math.ceil(num_tokens / KV_BLOCK_SIZE)
    k_cache = torch.empty(num_blocks, KV_BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, **gen)
    v_cache = torch.empty_like(k_cache)
    slot_mapping = torch.randperm(num_blocks * KV_BLOCK_SIZE, device=DEVICE)[:num_tokens]
    row, qk, kv = num_tokens * HIDDEN * 2, (query.numel() + key.numel()) * 2, 2 * key.numel() * 2
    kernels = {
        "rms_norm": (
            lambda: norm.rms_norm(x, weight, 1e-5),
            lambda: reference.rms_norm(x, weight, 1e-5),
            2 * row,
        ),
        "fused_add_rms_norm": (
            lambda: norm.fused_add_rms_norm(x, residual, weight, 1e-5),
            lambda: reference.fused_add_rms_norm(x, residual, weight, 1e-5),
            4 * row,
        ),
        "rotary_embedding": (
            lambda: rotary.rotary_embedding(positions, query, key, cos_sin_cache),
            lambda: reference.rotary_embedding(positions, query, key, cos_sin_cache),
            2 * qk,
        ),
        "silu_and_mul": (
            lambda: activation.silu_and_mul(gate_up),
            lambda: reference.silu_and_mul(gate_up),
            3 * num_tokens * INTERMEDIATE * 2,
        ),
        "write_kv_cache": (
            lambda: kv_cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping),
            # The reference's padding mask syncs the host, which a graph cannot hold: index_copy_ stands in.
            lambda: (
                k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, slot_mapping, key),
                v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(0, slot_mapping, value),
            ),
            2 * kv,
        ),
    }

    def body(triton_fn: Callable[[], object], torch_fn: Callable[[], object], num_bytes: int) -> dict:
        us = time_us(triton_fn, calls_per_graph=20, replays=50)
        result = {"us": us, "tb_per_s": num_bytes / us / 1e6}
        try:
            torch_us = time_us(torch_fn, calls_per_graph=20, replays=50)
            result.update(torch_reference_us=torch_us, speedup_vs_torch_reference=torch_us / us)
        except Exception as error:  # noqa: BLE001 - a reference that cannot be graphed is only context
            result["torch_reference_error"] = f"{type(error).__name__}: {error}"
        return result

    return {name: (lambda spec=spec: body(*spec)) for name, spec in kernels.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--sweep", action="store_true", help="also time other KV splits and tile configs")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the decode cases' cache")
    parser.add_argument("--decode-cases", default="1x2048,1x8192,32x2048,32x8192,128x2048,128x8192",
                        help="BATCHxCONTEXT,...")  # fmt: skip
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill and small kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    import triton

    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layout": {
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "kv_block_size": KV_BLOCK_SIZE,
            "dtype": str(DTYPE),
        },
        "decode": [],
        "prefill": [],
        "elementwise": [],
    }
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else DTYPE
    report["layout"]["kv_dtype"] = str(kv_dtype)
    for case in args.decode_cases.split(","):
        batch, context = (int(v) for v in case.split("x"))
        run_case(report["decode"], {"batch": batch, "context": context},
                 lambda b=batch, c=context: decode_case(b, c, args.sweep, kv_dtype))  # fmt: skip
        torch.cuda.empty_cache()
    for query_len, context_len in () if args.decode_only else ((8192, 0), (2048, 6144)):
        run_case(report["prefill"], {"query_len": query_len, "cached_prefix": context_len},
                 lambda q=query_len, c=context_len: prefill_case(q, c, args.sweep))  # fmt: skip
        torch.cuda.empty_cache()
    for num_tokens in () if args.decode_only else (128, 8192):
        for name, body in elementwise_cases(num_tokens).items():
            run_case(report["elementwise"], {"kernel": name, "num_tokens": num_tokens}, body)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
