"""`tokenmill bench serve`: drive an OpenAI-compatible server on a schedule (load.py), then summarize and
plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from tokenmill.bench.arrivals import (
    arrival_offsets,
    parse_request_rates,
    resolve_arrival_process,
    trace_offsets,
)
from tokenmill.bench.client import SAMPLING_PARAMS, Endpoint, resolve_endpoint
from tokenmill.bench.datasets import samples_from_args
from tokenmill.bench.load import ServeTarget, run_load, run_load_processes
from tokenmill.bench.metrics import (
    long_gaps,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    summarize,
)
from tokenmill.bench.report import format_rate, format_summary, format_sweep
from tokenmill.bench.result_files import parse_key_values, result_path, save_result
from tokenmill.bench.tokenizer import BenchTokenizer, load_tokenizer, resolve_tokenizer_source


def main(args: argparse.Namespace) -> int:
    """Run the benchmark at each requested rate; print, save and plot the results."""
    endpoint = resolve_endpoint(args.backend, args.endpoint)
    if endpoint.chat and args.prompts_as_token_ids:
        raise ValueError("--prompts-as-token-ids needs --endpoint /v1/completions (chat takes text)")
    percentiles = parse_percentiles(args.metric_percentiles)
    metrics = parse_metric_names(args.percentile_metrics)
    slos = parse_goodput(args.goodput or [])
    process = resolve_arrival_process(args.arrival_process, args.burstiness)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_client_processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {args.num_client_processes}")
    metadata = parse_key_values(args.metadata, "--metadata")
    extra_headers = parse_key_values(args.header, "--header")
    sweep = "," in (args.request_rate or "")
    if sweep and args.save_result and args.result_filename and not args.append_result:
        raise ValueError(
            "a --request-rate sweep writes one result per rate: drop --result-filename or add --append-result"
        )

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    headers |= extra_headers
    model = args.served_model_name or args.model
    model_root = None
    if model is None:
        model, model_root = _first_served_model(base_url, headers)
    # The served name finds the tokenizer too when it is a path or `default` (tokenmill's embedded model),
    # or else the listed model's root (where the server loaded it from), as vLLM looks there.
    source = resolve_tokenizer_source(args.tokenizer, args.model or model) or resolve_tokenizer_source(
        None, model_root
    )
    tokenizer = load_tokenizer(source) if source else None
    samples = samples_from_args(args, tokenizer)
    sampling = {name: getattr(args, name) for name, _ in SAMPLING_PARAMS if getattr(args, name) is not None}
    # vLLM asks a random workload for every requested token unless told otherwise.
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name == "random"
    target = ServeTarget(
        api_url=base_url + endpoint.path,
        model=model,
        chat=endpoint.chat,
        headers=headers,
        ignore_eos=ignore_eos,
        extra_body=sampling | (args.extra_body or {}),
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
        load = dict(
            max_concurrency=args.max_concurrency,
            num_warmups=args.num_warmups,
            tokenizer=tokenizer,
            show_progress=not args.disable_tqdm,
        )
        if args.num_client_processes > 1:
            run = run_load_processes(target, samples, offsets, processes=args.num_client_processes, **load)
        else:
            run = asyncio.run(run_load(target, samples, offsets, **load))
        if run.warmup_errors:
            print(
                f"warning: {len(run.warmup_errors)} warm-up requests failed: {run.warmup_errors[0]}",
                file=sys.stderr,
            )
        summary = summarize(
            run.results, run.duration_s, percentiles=percentiles, metrics=metrics, goodput_slos_ms=slos
        )
        summary = _with_run_info(
            summary,
            args,
            endpoint=endpoint,
            model=model,
            tokenizer=tokenizer,
            rate=rate,
            process=process,
            slos=slos,
        )
        summary |= metadata
        # Where the long gaps were, and the client's own pauses: a gap a client process made itself
        # lines up with one of its pauses; the server logs its processes' long pauses with wall times.
        summary["long_gaps"] = long_gaps(run.results, run.clock_to_wall)
        summary["client_gc"] = list(run.gc_pauses)
        summary["clock_to_wall"] = run.clock_to_wall  # perf_counter (the step trace's clock) to wall
        if replay:
            summary.update(request_rate="trace", trace_speedup=args.trace_speedup)
        print(format_summary(summary, percentiles=percentiles, metrics=metrics))
        summaries.append(summary)
        if args.save_result or args.append_result:
            path = result_path(
                label=args.label or endpoint.backend,
                rate="trace" if replay else rate,
                max_concurrency=args.max_concurrency,
                model_id=model,
                date=summary["date"],
                result_dir=args.result_dir,
                result_filename=args.result_filename,
            )
            save_result(summary, path, detailed=args.save_detailed, append=args.append_result)
            print(f"wrote {path}", file=sys.stderr)

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
    endpoint: Endpoint,
    model: str,
    tokenizer: BenchTokenizer | None,
    rate: float,
    process: str,
    slos: dict[str, float],
) -> dict[str, Any]:
    info = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": endpoint.backend,  # vLLM keeps both names for the backend
        "backend": endpoint.backend,
        "label": args.label,
        "base_url": args.base_url or f"http://{args.host}:{args.port}",
        "endpoint": endpoint.path,
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


def _first_served_model(base_url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    """Ask the server which model it serves when --model is not given: its name and its root."""

    async def fetch() -> tuple[str, str | None]:
        timeout = aiohttp.ClientTimeout(total=30)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{base_url}/v1/models", headers=headers) as response,
        ):
            response.raise_for_status()
            first = (await response.json())["data"][0]
            return first["id"], first.get("root")

    try:
        return asyncio.run(fetch())
    except aiohttp.ClientResponseError as exc:
        hint = "pass the server's key with --api-key" if exc.status in (401, 403) else "pass --model"
        raise ValueError(
            f"could not list models at {base_url}/v1/models ({exc.status} {exc.message}); {hint}"
        ) from None
    except (TimeoutError, aiohttp.ClientError, OSError, KeyError, IndexError) as exc:
        raise ValueError(f"could not list models at {base_url}/v1/models ({exc}); pass --model") from None


def _write_json(path: Path, payload: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
