"""`tokenmill bench serve`: drive an OpenAI-compatible server on a schedule, then summarize and plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from tokenmill.bench.arrivals import (
    arrival_offsets,
    parse_request_rates,
    resolve_arrival_process,
    trace_offsets,
)
from tokenmill.bench.client import ENDPOINTS, RequestInput, RequestResult, send_request
from tokenmill.bench.datasets import SampleRequest, samples_from_args
from tokenmill.bench.metrics import parse_goodput, parse_metric_names, parse_percentiles, summarize
from tokenmill.bench.report import format_rate, format_summary, format_sweep
from tokenmill.bench.tokenizer import BenchTokenizer, load_tokenizer, resolve_tokenizer_source


@dataclass(frozen=True)
class ServeTarget:
    """Where requests go and how each is shaped."""

    api_url: str
    model: str
    chat: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = False
    temperature: float = 0.0
    request_timeout_s: float = 6 * 3600.0


class LoadRun(NamedTuple):
    results: list[RequestResult]
    duration_s: float
    warmup_errors: list[str]


async def run_load(
    target: ServeTarget,
    samples: Sequence[SampleRequest],
    offsets: Sequence[float],
    *,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    tokenizer: BenchTokenizer | None = None,
    show_progress: bool = False,
) -> LoadRun:
    """Send `samples[i]` at `offsets[i]` seconds after the start, at most `max_concurrency` in flight.

    Warm-up requests (the first samples, cycled) run to completion before the clock starts and are
    not counted. The duration runs from the first timed send to the last response's end.
    """
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s)
    # No connection cap: the schedule and --max-concurrency alone decide how many requests are open.
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(sample: SampleRequest) -> RequestResult:
            request = RequestInput(
                api_url=target.api_url,
                model=target.model,
                prompt=sample.prompt,
                prompt_len=sample.prompt_len,
                max_tokens=sample.expected_output_len,
                chat=target.chat,
                ignore_eos=target.ignore_eos,
                temperature=target.temperature,
            )
            if limiter is None:
                return await send_request(session, request, headers=target.headers, tokenizer=tokenizer)
            async with limiter:
                return await send_request(session, request, headers=target.headers, tokenizer=tokenizer)

        warmups = [samples[i % len(samples)] for i in range(num_warmups)] if samples else []
        warmup_results = await asyncio.gather(*(one(s) for s in warmups))

        progress = _progress_bar(len(samples), show_progress)
        start = time.perf_counter()
        tasks = []
        for sample, offset in zip(samples, offsets, strict=True):
            # Sleep to an absolute send time, so scheduling jitter never accumulates.
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(sample))
            if progress is not None:
                task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
        results = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - start
        if progress is not None:
            progress.close()
    return LoadRun(results, duration_s, [r.error for r in warmup_results if not r.success])


def main(args: argparse.Namespace) -> int:
    """Run the benchmark at each requested rate; print, save and plot the results."""
    if args.endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {args.endpoint!r}")
    chat = args.endpoint == "/v1/chat/completions"
    if chat and args.prompts_as_token_ids:
        raise ValueError("--prompts-as-token-ids needs --endpoint /v1/completions (chat takes text)")
    percentiles = parse_percentiles(args.metric_percentiles)
    metrics = parse_metric_names(args.percentile_metrics)
    slos = parse_goodput(args.goodput or [])
    process = resolve_arrival_process(args.arrival_process, args.burstiness)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.served_model_name or args.model or _first_served_model(base_url, headers)
    # The served name finds the tokenizer too when it is a path or `default` (tokenmill's embedded model).
    source = resolve_tokenizer_source(args.tokenizer, args.model or model)
    tokenizer = load_tokenizer(source) if source else None
    samples = samples_from_args(args, tokenizer)
    target = ServeTarget(
        api_url=base_url + args.endpoint,
        model=model,
        chat=chat,
        headers=headers,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout,
    )
    replay = args.request_rate is None and all(s.timestamp_ms is not None for s in samples)
    rates = [math.inf] if replay else parse_request_rates(args.request_rate or "inf")

    summaries = []
    for rate in rates:
        if replay:
            offsets = trace_offsets([s.timestamp_ms for s in samples], args.trace_speedup)
            print(f"Replaying the trace's timestamps at {args.trace_speedup:g}x speed", file=sys.stderr)
        else:
            offsets = arrival_offsets(
                len(samples), rate, process=process, burstiness=args.burstiness, seed=args.seed
            )
            print(
                f"Request rate: {format_rate(rate)} ({process}, burstiness {args.burstiness:g}), "
                f"max concurrency: {args.max_concurrency or 'unlimited'}",
                file=sys.stderr,
            )
        run = asyncio.run(
            run_load(
                target,
                samples,
                offsets,
                max_concurrency=args.max_concurrency,
                num_warmups=args.num_warmups,
                tokenizer=tokenizer,
                show_progress=not args.disable_tqdm,
            )
        )
        if run.warmup_errors:
            print(
                f"warning: {len(run.warmup_errors)} warm-up requests failed: {run.warmup_errors[0]}",
                file=sys.stderr,
            )
        summary = summarize(
            run.results, run.duration_s, percentiles=percentiles, metrics=metrics, goodput_slos_ms=slos
        )
        summary = _with_run_info(
            summary, args, model=model, tokenizer=tokenizer, rate=rate, process=process, slos=slos
        )
        if replay:
            summary.update(request_rate="trace", trace_speedup=args.trace_speedup)
        print(format_summary(summary, percentiles=percentiles, metrics=metrics))
        summaries.append(summary)

    if len(summaries) > 1:
        print(format_sweep(summaries, percentile=max(percentiles)))
    if args.output_json:
        _write_json(Path(args.output_json), summaries[0] if len(summaries) == 1 else summaries)
    if args.plot:
        from tokenmill.bench.plots import write_plots

        for path in write_plots(summaries, Path(args.plot), slos_ms=slos, percentile=max(percentiles)):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if all(s["completed"] > 0 for s in summaries) else 1


def _with_run_info(
    summary: dict[str, Any],
    args: argparse.Namespace,
    *,
    model: str,
    tokenizer: BenchTokenizer | None,
    rate: float,
    process: str,
    slos: dict[str, float],
) -> dict[str, Any]:
    info = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "tokenmill-bench",
        "endpoint_type": "openai-chat" if args.endpoint.endswith("chat/completions") else "openai",
        "base_url": args.base_url or f"http://{args.host}:{args.port}",
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": tokenizer.name if tokenizer is not None else None,
        "dataset_name": args.dataset_name,
        "num_prompts": len(summary["errors"]),
        "request_rate": "inf" if math.isinf(rate) else rate,
        "arrival_process": process,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "num_warmups": args.num_warmups,
        "goodput_slos_ms": slos or None,
    }
    return {**info, **summary}


def _first_served_model(base_url: str, headers: dict[str, str]) -> str:
    """Ask the server which model it serves when --model is not given."""

    async def fetch() -> str:
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{base_url}/v1/models", headers=headers) as response,
        ):
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]

    try:
        return asyncio.run(fetch())
    except (TimeoutError, aiohttp.ClientError, OSError, KeyError, IndexError) as exc:
        raise ValueError(f"could not list models at {base_url}/v1/models ({exc}); pass --model") from None


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr)


def _write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
