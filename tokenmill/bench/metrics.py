"""Per-request results -> the run's summary, under the key names of `vllm bench serve`'s JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenmill.bench.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
# `vllm bench serve`'s defaults: percentiles of TTFT, TPOT and ITL, p99 only.
DEFAULT_METRICS = ("ttft", "tpot", "itl")
DEFAULT_PERCENTILES = (99.0,)
# The per-request lists, which vLLM writes only with --save-detailed.
PER_REQUEST_KEYS = (
    "input_lens",
    "output_lens",
    "start_times",
    "ttfts",
    "tpots",
    "itls",
    "generated_texts",
    "errors",
)


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0}: service-level objectives in ms."""
    slos: dict[str, float] = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput takes METRIC:MS with METRIC in {', '.join(GOODPUT_METRICS)}, got {spec!r}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {spec!r}: the objective must be >= 0 ms")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`--metric-percentiles 50,90,99.9` -> [50.0, 90.0, 99.9], each in [0, 100]."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers separated by commas, got {text!r}") from None
    if any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles must be in [0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    """`--percentile-metrics ttft,tpot` -> ["ttft", "tpot"]."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics takes names from {', '.join(METRICS)}, got {text!r}")
    return names


def percentile_label(percentile: float) -> str:
    """99 -> "p99", 99.9 -> "p99.9", as vLLM spells its keys."""
    return f"p{int(percentile)}" if percentile == int(percentile) else f"p{percentile}"


def meets_slos(result: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a completed request met every objective; a one-token answer has no TPOT to miss."""
    values_ms = {"ttft": result.ttft * 1e3, "e2el": result.latency * 1e3}
    if result.tpot is not None:
        values_ms["tpot"] = result.tpot * 1e3
    return all(values_ms.get(name, 0.0) <= limit for name, limit in slos_ms.items())


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    metrics: Sequence[str] = METRICS,
    goodput_slos_ms: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The run's numbers. Latencies are reported in ms; per-request lists keep vLLM's units (s)."""
    done = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    samples_ms = {
        "ttft": [r.ttft * 1e3 for r in done],
        "tpot": [r.tpot * 1e3 for r in done if r.tpot is not None],
        "itl": [gap * 1e3 for r in done for gap in r.itl],
        "e2el": [r.latency * 1e3 for r in done],
    }
    duration = max(duration_s, 1e-9)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_output_tokens_per_s": _peak_output_tokens_per_s(done),
        "max_concurrent_requests": _peak_concurrency(done),
    }
    if goodput_slos_ms:
        summary["request_goodput"] = sum(meets_slos(r, goodput_slos_ms) for r in done) / duration
    for name in metrics:
        values = np.asarray(samples_ms[name], dtype=np.float64)
        summary[f"mean_{name}_ms"] = float(values.mean()) if values.size else 0.0
        summary[f"median_{name}_ms"] = float(np.median(values)) if values.size else 0.0
        summary[f"std_{name}_ms"] = float(values.std()) if values.size else 0.0
        for p in percentiles:
            summary[f"{percentile_label(p)}_{name}_ms"] = (
                float(np.percentile(values, p)) if values.size else 0.0
            )
    summary.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_tokens for r in results],
        ttfts=[r.ttft for r in results],
        tpots=[r.tpot for r in results],
        itls=[r.itl for r in results],
        latencies=[r.latency for r in results],
        start_times=[r.start_time for r in results],
        generated_texts=[r.generated_text for r in results],
        errors=[r.error for r in results],
    )
    return summary


def long_gaps(
    results: Sequence[RequestResult], clock_to_wall: float, over_s: float = 0.1, limit: int = 500
) -> list[tuple[float, int, int, float, int, int]]:
    """Inter-token gaps of at least over_s, in time order (at most `limit`): (wall-clock time the gap
    ended, request index, chunk index in its stream, milliseconds, characters the chunk that ended it
    carried, how many of them are U+FFFD). A long chunk full of U+FFFD after a gap is text the server
    held back while the tokens did not yet decode to whole characters, not a late server.
    clock_to_wall: time.time() minus time.perf_counter(), the clock the results' times are on; wall
    times line up with server logs."""
    gaps = []
    for index, result in enumerate(results):
        if not result.success:
            continue
        arrival = result.start_time + result.ttft
        for chunk, gap in enumerate(result.itl, start=1):
            arrival += gap
            if gap >= over_s:
                start = sum(result.chunk_chars[:chunk])  # rare: no running offsets for every stream
                text = (
                    result.generated_text[start : start + result.chunk_chars[chunk]]
                    if result.chunk_chars
                    else ""
                )
                gaps.append(
                    (
                        round(arrival + clock_to_wall, 4),
                        index,
                        chunk,
                        round(gap * 1e3, 2),
                        len(text),
                        text.count("\ufffd"),
                    )
                )
    return sorted(gaps)[:limit]


def error_counts(errors: Sequence[str]) -> list[tuple[str, int]]:
    """Distinct failure messages with how often each occurred, most frequent first."""
    counts: dict[str, int] = {}
    for message in errors:
        if message:
            counts[message] = counts.get(message, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def _peak_concurrency(done: Sequence[RequestResult]) -> int:
    # Sweep over start (+1) and end (-1) events; ends sort first at equal times.
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _peak_output_tokens_per_s(done: Sequence[RequestResult]) -> float:
    """The most output tokens delivered in any one-second window aligned to the first send."""
    if not done:
        return 0.0
    origin = min(r.start_time for r in done)
    per_second: dict[int, float] = {}
    for r in done:
        times = r.chunk_times
        tokens_per_chunk = r.output_tokens / len(times)
        for t in times:
            second = int(t - origin)
            per_second[second] = per_second.get(second, 0.0) + tokens_per_chunk
    return max(per_second.values())
