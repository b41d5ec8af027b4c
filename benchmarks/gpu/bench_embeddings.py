"""Embeddings throughput (issue 10): the Qwen3-0.6B shape as a bare model (Qwen3Model, dummy weights,
vocab 49,152), inputs of INPUT_LEN random token ids, pooled by the last token. Offline (LLM.embed) and
through `tokenmill serve` + /v1/embeddings (CONCURRENCY requests of BATCH inputs in flight, base64 as
the openai client asks for it) on the same inputs, in one call; prints and writes JSON with input
tokens/s, the ratio server/offline, and the ratio to the card's matmul rate (--peak-tflops).

    python benchmarks/gpu/bench_embeddings.py --out OUT.json [--num-inputs 8192] [--input-len 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from local_server import local_server  # noqa: E402
from shapes import prefill_flops, shape_dir  # noqa: E402

SHAPE = "qwen3-0.6b"


def inputs(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(num)]


def offline(model: str, prompts: list[list[int]], warmup: list[list[int]]) -> dict:
    import torch

    from tokenmill.entrypoints.llm import LLM

    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    assert llm.engine.pooling_type == "last"
    llm.embed(prompt_token_ids=warmup, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.embed(prompt_token_ids=prompts, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(outputs[0].outputs.embedding) == 1024
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"elapsed_s": elapsed, "tokens_per_s": sum(map(len, prompts)) / elapsed}


async def _load(base: str, prompts: list[list[int]], batch: int, concurrency: int) -> float:
    import httpx

    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    queue: asyncio.Queue = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as client:

        async def worker() -> None:
            while not queue.empty():
                chunk = queue.get_nowait()
                body = {"model": "m", "input": chunk, "encoding_format": "base64"}
                response = await client.post(f"{base}/v1/embeddings", json=body)
                response.raise_for_status()
                assert len(response.json()["data"]) == len(chunk)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def served(model: str, prompts, warmup, batch: int, concurrency: int, port: int, log: str) -> dict:
    flags = ["--model", model, "--served-model-name", "m", "--load-format", "dummy", "--skip-tokenizer-init",
             "--max-model-len", "4096", "--no-access-log"]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    with local_server(flags, port, log):
        asyncio.run(_load(base, warmup, batch, concurrency))
        elapsed = asyncio.run(_load(base, prompts, batch, concurrency))
    return {"elapsed_s": elapsed, "tokens_per_s": sum(map(len, prompts)) / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-inputs", type=int, default=8192)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16, help="inputs per /v1/embeddings request")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--port", type=int, default=8331)
    parser.add_argument("--peak-tflops", type=float, default=752.0, help="measured bf16 matmul rate")
    args = parser.parse_args()
    model = shape_dir(SHAPE, architectures=["Qwen3Model"], vocab_size=49152, bos_token_id=1, eos_token_id=2)
    prompts = inputs(args.num_inputs, args.input_len, seed=0)
    warmup = inputs(min(512, args.num_inputs), args.input_len, seed=1)
    result = {"shape": SHAPE, "num_inputs": args.num_inputs, "input_len": args.input_len,
              "batch": args.batch, "concurrency": args.concurrency}  # fmt: skip
    result["offline"] = offline(model, prompts, warmup)
    log = os.path.join(os.path.dirname(os.path.abspath(args.out)), "embeddings_server.log")
    result["server"] = served(model, prompts, warmup, args.batch, args.concurrency, args.port, log)
    result["server_over_offline"] = result["server"]["tokens_per_s"] / result["offline"]["tokens_per_s"]
    flops_per_token = prefill_flops(SHAPE, args.input_len) / args.input_len
    for key in ("offline", "server"):
        tflops = result[key]["tokens_per_s"] * flops_per_token / 1e12
        result[key]["tflops"] = tflops
        result[key]["fraction_of_matmul_peak"] = tflops / args.peak_tflops
    print(json.dumps(result, indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
