"""The CPU tier's copy speed against the card's own pinned-memory copy (issue 15's restore goal: >= 70%).

Caches of the Llama-3.1-8B shape (32 layers, 8 KV heads of 128, bf16, blocks of 16 tokens: 2 MiB a
block over all layers), a pinned host pool, and worker/kv_offload.py's HostKVCache: loads and saves of
N blocks (host blocks in runs, as the pool hands them out, and scattered), timed with CUDA events from
the first copy to the last scatter, against one contiguous pinned copy of the same bytes. JSON on
stdout (and --out).

    python benchmarks/gpu/bench_kv_offload.py [--blocks 512] [--out FILE]   (--device cpu: a smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenmill.worker.kv_offload import HostKVCache  # noqa: E402


def timed(device: torch.device, work, repeats: int = 5) -> float:
    """Median seconds of work() over repeats, after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            work()
            times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--blocks", type=int, default=512, help="blocks per transfer")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    n = args.blocks
    layers = [
        types.SimpleNamespace(
            k_cache=torch.zeros(4 * n, 16, 8, 128, dtype=torch.bfloat16, device=device),
            v_cache=torch.zeros(4 * n, 16, 8, 128, dtype=torch.bfloat16, device=device),
            num_kv_heads=8,
            head_dim=128,
        )  # fmt: skip
        for _ in range(args.layers)
    ]
    host = HostKVCache(layers, 2 * n, device)
    nbytes = n * host.block_bytes
    generator = torch.Generator().manual_seed(0)
    device_blocks = torch.randperm(4 * n, generator=generator)[:n].tolist()
    runs = list(range(n))  # consecutive host blocks, as a fresh pool hands them out
    scattered = torch.randperm(2 * n, generator=generator)[:n].tolist()
    # The ceiling: one contiguous pinned copy of the same bytes, each way.
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "blocks": n, "block_bytes": host.block_bytes, "bytes": nbytes,
        "pinned_h2d_s": timed(device, lambda: on_device.copy_(pinned, non_blocking=True)),
        "pinned_d2h_s": timed(device, lambda: pinned.copy_(on_device, non_blocking=True)),
        "save_runs_s": timed(device, lambda: host.transfer(list(zip(device_blocks, runs)), [])),
        "save_scattered_s": timed(device, lambda: host.transfer(list(zip(device_blocks, scattered)), [])),
        "load_runs_s": timed(device, lambda: host.transfer([], list(zip(runs, device_blocks)))),
        "load_scattered_s": timed(device, lambda: host.transfer([], list(zip(scattered, device_blocks)))),
    }  # fmt: skip
    for key in [k for k in results if k.endswith("_s")]:
        results[key.removesuffix("_s") + "_gb_s"] = nbytes / results[key] / 1e9
    results["load_runs_vs_pinned_h2d"] = results["pinned_h2d_s"] / results["load_runs_s"]
    results["load_scattered_vs_pinned_h2d"] = results["pinned_h2d_s"] / results["load_scattered_s"]
    results["save_runs_vs_pinned_d2h"] = results["pinned_d2h_s"] / results["save_runs_s"]
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
