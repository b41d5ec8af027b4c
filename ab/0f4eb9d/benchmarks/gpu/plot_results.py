"""One picture of a GPU run: each benchmark as a fraction of its goal, with the roofline and the peer.
Usage: python benchmarks/gpu/plot_results.py RESULTS_DIR OUT.png"""

from __future__ import annotations

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def newest(folder: str, pattern: str) -> dict:
    paths = sorted(glob.glob(os.path.join(folder, pattern)), key=os.path.getmtime)
    with open(paths[-1]) as f:
        return json.load(f)


def main(folder: str, out: str) -> None:
    ceilings = newest(folder, "ceilings.json")
    decode = max(
        (load(p) for p in glob.glob(os.path.join(folder, "decode_8b_*.json")) if "torch" not in p),
        key=lambda d: d["decode_tok_s"],
    )
    decode_torch = newest(folder, "decode_8b_torch.json")
    prefill, prefill_torch = newest(folder, "prefill_8b.json"), newest(folder, "prefill_8b_torch.json")
    small = max(
        (load(p) for p in glob.glob(os.path.join(folder, "throughput_qwen3*.json"))),
        key=lambda d: d["ours"]["all"]["output_tok_s"],
    )
    large = max(
        (load(p) for p in glob.glob(os.path.join(folder, "throughput_llama*.json"))),
        key=lambda d: d["ours"]["all"]["output_tok_s"],
    )

    roofline_tok_s = ceilings["copy_bandwidth_Bps"] / decode["bytes_per_step"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))

    ax = axes[0]
    labels = ["roofline\n(copy BW)", "tokenmill\nTriton+graphs", "tokenmill\ntorch ref"]
    values = [roofline_tok_s, decode["decode_tok_s"], decode_torch["decode_tok_s"]]
    ax.bar(labels, values, color=["#bbbbbb", "#2b6cb0", "#90cdf4"])
    ax.axhline(0.85 * roofline_tok_s, color="red", ls="--", label="goal: 85% of roofline")
    ax.set_title("Batch-1 decode, Llama-3.1-8B shape (tok/s)")
    ax.legend()

    ax = axes[1]
    labels = ["matmul rate", "tokenmill\nTriton+cuDNN", "tokenmill\ntorch ref"]
    values = [
        ceilings["bf16_matmul_flops"] / 1e12,
        prefill["achieved_flops"] / 1e12,
        prefill_torch["achieved_flops"] / 1e12,
    ]
    ax.bar(labels, values, color=["#bbbbbb", "#2b6cb0", "#90cdf4"])
    ax.axhline(0.6 * values[0], color="red", ls="--", label="goal: 60% of matmul rate")
    ax.set_title("Prefill of 8,192 tokens, 8B shape (TFLOP/s)")
    ax.legend()

    ax = axes[2]
    x = [0, 1, 3, 4]
    values = [
        small["ours"]["all"]["output_tok_s"],
        small["ours"]["subset"]["output_tok_s"],
        large["ours"]["all"]["output_tok_s"],
        large["ours"]["subset"]["output_tok_s"],
    ]
    peers = [small["peer"]["output_tok_s"], large["peer"]["output_tok_s"]]
    ax.bar(x, values, color=["#2b6cb0", "#63b3ed", "#2b6cb0", "#63b3ed"])
    ax.bar([1.4, 4.4], peers, width=0.4, color="#ed8936", label="transformers CB (16 requests)")
    ax.hlines(
        [20000, 10000], [-0.4, 2.6], [1.8, 4.8], colors="red", linestyles="--", label="goals (256 requests)"
    )
    ax.set_xticks([0, 1.2, 3, 4.2], ["0.6B: 256 req", "0.6B: 16 req", "8B: 256 req", "8B: 16 req"])
    ax.set_title("Offline throughput, nano-vllm workload (output tok/s)")
    ax.legend(fontsize=8)
    fig.suptitle(
        f"tokenmill on {ceilings['device']}: measured copy {ceilings['copy_bandwidth_Bps'] / 1e12:.2f} TB/s, "
        f"bf16 matmul {ceilings['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
