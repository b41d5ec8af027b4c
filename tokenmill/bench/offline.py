"""`bench throughput` and `bench latency`: the engine in-process through `tokenmill.LLM`, no HTTP.

The engine (and with it torch) is imported inside the functions, so the bench room stays light.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tokenmill.bench.datasets import samples_from_args
from tokenmill.bench.prompts import PromptMaker
from tokenmill.bench.tokenizer import BenchTokenizer, load_tokenizer, resolve_tokenizer_source

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def throughput_main(args: argparse.Namespace) -> int:
    """All requests handed to the engine at once, EOS ignored: requests/s and tokens/s."""
    from tokenmill import SamplingParams

    tokenizer = _tokenizer(args)
    args.prompts_as_token_ids = True  # the engine takes ids; no detokenize/retokenize round trip
    samples = samples_from_args(args, tokenizer)
    llm = _make_llm(args)
    constraint = getattr(args, "structured_outputs", None)
    params = [
        SamplingParams(
            max_tokens=s.expected_output_len, temperature=args.temperature, ignore_eos=True,
            structured_outputs=constraint,
        )
        for s in samples
    ]  # fmt: skip
    prompts = [list(s.prompt) for s in samples]
    # Warm-up at full prompt length, not timed: the first batch meets new kernel variants (and the
    # constraint's first compilation).
    warm = prompts[: args.num_warmups]
    if warm:
        llm.generate(
            sampling_params=SamplingParams(max_tokens=4, ignore_eos=True, structured_outputs=constraint),
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
        "speculative_decoding": speculation_stats(llm) if getattr(args, "speculative_config", None) else None,
        "structured_outputs": structured_stats(llm) if constraint else None,
        "loop": loop_stats(llm),
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


def structured_stats(llm) -> dict:
    """The host time spent filling grammar masks (the step waits for it), per step that needed one."""
    scheduler = llm.engine.scheduler
    steps = scheduler.grammar_mask_steps
    return {
        "steps_with_masks": steps,
        "mask_ms_per_step": scheduler.grammar_mask_seconds / steps * 1e3 if steps else None,
    }


def loop_stats(llm) -> dict | None:
    """The step loop's own waits, per step of the run (warm-up included): for the masks of the grammar
    step before (then queueing its sampling), and for the oldest step's tokens (then reading them).
    None for an engine without a core loop (a stand-in)."""
    core = getattr(llm.engine, "core", None)
    if core is None:
        return None
    per_step = 1e3 / core.num_steps if core.num_steps else 0.0
    return {
        "steps": core.num_steps,
        "ms_per_step_on_masks": core.seconds_on_masks * per_step,
        "ms_per_step_on_tokens": core.seconds_on_tokens * per_step,
    }


def latency_main(args: argparse.Namespace) -> int:
    """One batch of `--batch-size` prompts, stepped to its first token and to its last, many times.

    Every run, warm-up included, gets fresh random prompts: repeating them would let the prefix cache
    serve the prefill. Prefix caching is also off unless --enable-prefix-caching asks for it.
    """
    from tokenmill import SamplingParams

    if min(args.batch_size, args.input_len, args.output_len) < 1 or args.num_iters < 1:
        raise ValueError("--batch-size, --input-len, --output-len and --num-iters must be >= 1")
    maker = PromptMaker(_tokenizer(args), np.random.default_rng(args.seed))
    llm = _make_llm(args, enable_prefix_caching=args.enable_prefix_caching)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True)
    runs = []
    for run in range(args.num_iters_warmup + args.num_iters):
        # A random KV block of B tokens repeats with odds of vocab_size**-B: no two prompts share a prefix.
        prompts = [maker.random_ids(args.input_len) for _ in range(args.batch_size)]
        request_ids = [f"latency-{run}-{i}" for i in range(args.batch_size)]
        runs.append(_step_batch(llm.engine, request_ids, prompts, params))
    timed = runs[args.num_iters_warmup :]
    ttfts = [r.ttft for r in timed]
    latencies = [r.latency for r in timed]
    steps = [r.decode_step for r in timed if r.num_decode_steps > 0]
    result = {
        "model_id": args.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "enable_prefix_caching": args.enable_prefix_caching,
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in LATENCY_PERCENTILES},
        "ttfts": ttfts,
        "decode_step_latencies": steps,
        "ttft_ms": _stats_ms(ttfts),
        "decode_step_ms": _stats_ms(steps),
        "e2e_latency_ms": _stats_ms(latencies),
        "decode_tokens_per_second": args.batch_size / float(np.mean(steps)) if steps else None,
        "num_cached_prompt_tokens": sum(r.num_cached_tokens for r in timed),
    }
    print(_format_latency(result))
    _write_json(args.output_json, result)
    return 0


class BatchRun(NamedTuple):
    """One batch stepped to its end; every time is from the moment its requests were added."""

    ttft: float  # until every request had its first token: the batch's prefill
    latency: float  # until the last request finished
    num_decode_steps: int  # engine steps after the prefill, each one token for every request still running
    num_cached_tokens: int  # prompt tokens the prefix cache served

    @property
    def decode_step(self) -> float:
        return (self.latency - self.ttft) / self.num_decode_steps


def _step_batch(engine: Any, request_ids: list[str], prompts: list[list[int]], params: Any) -> BatchRun:
    """Step the engine through one batch, timing its prefill and its decode steps within the same run.

    Timing a first-token run and a full run apart and subtracting lets their noise make the decode
    step negative; two moments of one run cannot.
    """
    start = time.perf_counter()
    for request_id, prompt in zip(request_ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    awaiting_first_token, unfinished = set(request_ids), set(request_ids)
    prefilled_at: float | None = None
    num_decode_steps = num_cached_tokens = 0
    while unfinished:
        outputs = engine.step()  # an output means a sampled token: prompt chunks return none
        now = time.perf_counter()
        if outputs and prefilled_at is not None:
            num_decode_steps += 1
        for output in outputs:
            awaiting_first_token.discard(output.request_id)
            if output.finished:
                unfinished.discard(output.request_id)
                num_cached_tokens += output.num_cached_tokens
        if prefilled_at is None and not awaiting_first_token:
            prefilled_at = now
        if unfinished and not engine.has_unfinished_requests():
            raise RuntimeError(f"engine stopped with {len(unfinished)} requests unfinished.")
    # With async scheduling a step may still be in flight; let it land so the next run starts idle.
    while engine.has_unfinished_requests():
        engine.step()
    assert prefilled_at is not None
    return BatchRun(prefilled_at - start, now - start, num_decode_steps, num_cached_tokens)


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
    titles = (
        ("TTFT (batch prefill + first token)", "ttft_ms"),
        ("Decode step", "decode_step_ms"),
        ("End-to-end latency", "e2e_latency_ms"),
    )
    for title, key in titles:
        stats = result[key]
        if stats:
            lines.append(
                f"{title}: mean {stats['mean']:.2f} ms, median {stats['median']:.2f} ms, "
                f"p90 {stats['p90']:.2f} ms, p99 {stats['p99']:.2f} ms"
            )
    if result["decode_tokens_per_second"]:
        lines.append(f"Decode throughput: {result['decode_tokens_per_second']:.1f} tokens/s")
    if result["enable_prefix_caching"]:
        lines.append(f"Prompt tokens served by the prefix cache: {result['num_cached_prompt_tokens']}")
    return "\n".join(lines)


def _tokenizer(args: argparse.Namespace) -> BenchTokenizer:
    source = resolve_tokenizer_source(args.tokenizer, args.model)
    if source is None:
        raise ValueError(f"no tokenizer for --model {args.model!r}; pass --tokenizer DIR|FILE.gguf")
    return load_tokenizer(source)


def _make_llm(args: argparse.Namespace, **engine_overrides: Any) -> Any:
    from tokenmill import LLM

    engine_args = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_prefill_tokens_with_decodes": args.max_prefill_tokens_with_decodes,
        "skip_tokenizer_init": args.skip_tokenizer_init or None,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": getattr(args, "speculative_config", None),
        **engine_overrides,
    }
    return LLM(**{k: v for k, v in engine_args.items() if v is not None})


def speculation_stats(llm: Any) -> dict[str, Any] | None:
    """The drafts' acceptance over the run (vLLM's names), None without speculation: mean accepted
    length counts the target's own token, so it is the tokens each verifying step produced."""
    scheduler = llm.engine.scheduler
    if not scheduler.spec.num_drafts:
        return None
    drafts, proposed = scheduler.spec.num_drafts, scheduler.spec.num_draft_tokens
    accepted = scheduler.spec.num_accepted_tokens
    return {
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "draft_acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts,
        "accepted_per_position": [count / drafts for count in scheduler.spec.accepted_per_position],
    }


def _write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
