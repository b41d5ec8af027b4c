"""What the API process spends per streamed token (issue 10: it is the server's bottleneck on the H200),
measured on a CPU: `tokenmill serve` runs a tiny Llama shape (2 layers, hidden 64, SmolLM2's vocab and
tokenizer) whose engine core steps 100+ streams in a few ms, so the API process is loaded as on the GPU;
`tokenmill bench serve` streams random 512-in / 256-out requests. Prints the API process's CPU
microseconds per output token (user + system, from /proc), and the server's output tokens/s.

    python benchmarks/cpu_api_cost.py [--concurrency 128] [--num-prompts 256] [--cprofile OUT.prof]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import psutil
from local_server import local_server

from tokenmill.loader.default_model import default_model_path

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 49152, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True, "torch_dtype": "float32",
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--port", type=int, default=8021)
    parser.add_argument("--cprofile", help="run the API process under cProfile, stats to this file")
    args = parser.parse_args()
    model = tempfile.mkdtemp(prefix="tokenmill-tiny-")
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(TINY, f)
    tokenizer = default_model_path()
    base = f"http://127.0.0.1:{args.port}"
    profiler = ["-m", "cProfile", "-o", args.cprofile] if args.cprofile else []
    flags = ["--model", model, "--load-format", "dummy", "--tokenizer", tokenizer, "--no-access-log",
             "--max-model-len", "1024", "--num-kv-blocks", "20000",
             "--max-num-batched-tokens", "2048"]  # fmt: skip
    with local_server(flags, args.port, python_flags=profiler) as server:
        api = psutil.Process(server.pid)
        out = os.path.join(model, "serve.json")
        client = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve", "--temperature", "0",
                  "--base-url", base, "--tokenizer", tokenizer, "--dataset-name", "random",
                  "--random-input-len", "512",
                  "--random-output-len", "256", "--ignore-eos", "--num-prompts", str(args.num_prompts),
                  "--max-concurrency", str(args.concurrency), "--seed", "0", "--disable-tqdm",
                  "--output-json", out]  # fmt: skip
        before = api.cpu_times()
        subprocess.run(client, check=True, stdout=subprocess.DEVNULL)
        after = api.cpu_times()
        with open(out) as f:
            result = json.load(f)
    cpu_s = (after.user - before.user) + (after.system - before.system)
    tokens = result["total_output_tokens"]
    print(json.dumps({
        "api_cpu_us_per_token": round(cpu_s / tokens * 1e6, 2),
        "api_cpu_s": round(cpu_s, 2),
        "output_tokens": tokens,
        "output_tok_s": round(result["output_throughput"]),
        "median_itl_ms": round(result["median_itl_ms"], 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
