"""`bench throughput` and `bench latency`: the engine in-process through `tokenmill.LLM`, no HTTP.

The engine (and with it torch) is imported inside the functions, so the bench room stays light.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.datasets import PromptMaker, samples_from_args
from tokenmill.bench.tokenizer import BenchTokenizer, load_tokenizer, resolve_tokenizer_source

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def throughput_main(args: argparse.Namespace) -> int:
    """All requests handed to the engine at once, EOS ignored: requests/s and tokens/s."""
    from tokenmill import SamplingParams

    tokenizer = _tokenizer(args)
    args.prompts_as_token_ids = True  # the engine takes ids; no detokenize/retokenize round trip
    samples = samples_from_args(args, tokenizer)
    llm = _make_llm(args)
    params = [
        SamplingParams(max_tokens=s.expected_output_len, temperature=args.temperature, ignore_eos=True)
        for s in samples
    ]
    prompts = [list(s.prompt) for s in samples]
    # Warm-up at full prompt length, not timed: the first batch meets new kernel variants.
    warm = prompts[: args.num_warmups]
    if warm:
        llm.generate(
            sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
            prompt_token_ids=warm,
            use_tqdm=False,
        )
    start = time.perf_counter()
    outputs = llm.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model_id": args.model,
        "dataset_name": args.dataset_name,
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_num_tokens": input_tokens + output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (input_tokens + output_tokens) / elapsed,
        "input_tokens_per_second": input_tokens / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, "
        f"{result['tokens_per_second']:.1f} total tokens/s, "
        f"{result['input_tokens_per_second']:.1f} input tokens/s, "
        f"{result['output_tokens_per_second']:.1f} output tokens/s "
        f"({len(outputs)} requests, {input_tokens} input + {output_tokens} output tokens in {elapsed:.2f} s)"
    )
    _write_json(args.output_json, result)
    return 0


def latency_main(args: argparse.Namespace) -> int:
    """One batch of `--batch-size` prompts, timed to its first token and to its last, many times."""
    from tokenmill import SamplingParams

    if min(args.batch_size, args.input_len, args.output_len) < 1 or args.num_iters < 1:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1")
    maker = PromptMaker(_tokenizer(args), np.random.default_rng(args.seed))
    prompts = [maker.random_ids(args.input_len) for _ in range(args.batch_size)]
    llm = _make_llm(args)
    first_token = SamplingParams(max_tokens=1, temperature=args.temperature, ignore_eos=True)
    full = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)

    def timed(params: Any) -> float:
        start = time.perf_counter()
        llm.generate(sampling_params=params, prompt_token_ids=prompts, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        timed(full)
    ttfts, latencies = [], []
    for _ in range(args.num_iters):
        ttfts.append(timed(first_token))
        latencies.append(timed(full))
    # The batch's decode steps are what the full run adds beyond its first token.
    steps = [(lat - ttft) / (args.output_len - 1) for lat, ttft in zip(latencies, ttfts, strict=True)]
    steps = steps if args.output_len > 1 else []
    result = {
        "model_id": args.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in LATENCY_PERCENTILES},
        "ttfts": ttfts,
        "decode_step_latencies": steps,
        "ttft_ms": _stats_ms(ttfts),
        "decode_step_ms": _stats_ms(steps),
        "decode_tokens_per_second": args.batch_size / float(np.mean(steps)) if steps else None,
    }
    print(_format_latency(result))
    _write_json(args.output_json, result)
    return 0


def _stats_ms(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {}
    values = np.asarray(values_s) * 1e3
    stats = {"mean": float(values.mean()), "median": float(np.median(values)), "std": float(values.std())}
    stats.update({f"p{p}": float(np.percentile(values, p)) for p in (90, 99)})
    return stats


def _format_latency(result: dict[str, Any]) -> str:
    lines = [
        f"batch {result['batch_size']} x {result['input_len']} input -> {result['output_len']} output "
        f"tokens, {len(result['latencies'])} iterations",
        f"Avg latency: {result['avg_latency']:.4f} s",
    ]
    for title, key in (("TTFT (batch prefill + first token)", "ttft_ms"), ("Decode step", "decode_step_ms")):
        stats = result[key]
        if stats:
            lines.append(
                f"{title}: mean {stats['mean']:.2f} ms, median {stats['median']:.2f} ms, "
                f"p90 {stats['p90']:.2f} ms, p99 {stats['p99']:.2f} ms"
            )
    if result["decode_tokens_per_second"]:
        lines.append(f"Decode throughput: {result['decode_tokens_per_second']:.1f} tokens/s")
    return "\n".join(lines)


def _tokenizer(args: argparse.Namespace) -> BenchTokenizer:
    source = resolve_tokenizer_source(args.tokenizer, args.model)
    if source is None:
        raise ValueError(f"no tokenizer for --model {args.model!r}; pass --tokenizer DIR|FILE.gguf")
    return load_tokenizer(source)


def _make_llm(args: argparse.Namespace) -> Any:
    from tokenmill import LLM

    engine_args = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "skip_tokenizer_init": args.skip_tokenizer_init or None,
    }
    return LLM(**{k: v for k, v in engine_args.items() if v is not None})


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
