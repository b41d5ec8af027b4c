"""The terminal report of one run (laid out like vLLM's) and the one-line-per-rate sweep table."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from tokenmill.bench.metrics import error_counts, percentile_label

WIDTH = 50
_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def format_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def format_summary(
    summary: Mapping[str, Any], *, percentiles: Sequence[float], metrics: Sequence[str], max_errors: int = 5
) -> str:
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    if summary.get("max_concurrency") is not None:
        row("Maximum request concurrency:", summary["max_concurrency"])
    if isinstance(summary.get("request_rate"), float | int) and math.isfinite(summary["request_rate"]):
        row("Request rate configured (RPS):", float(summary["request_rate"]))
    row("Benchmark duration (s):", summary["duration"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    if summary.get("request_goodput") is not None:
        row("Request goodput (req/s):", summary["request_goodput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Peak output token throughput (tok/s):", summary["max_output_tokens_per_s"])
    row("Peak concurrent requests:", summary["max_concurrent_requests"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    for name in metrics:
        title, short = _TITLES[name]
        lines.append(f" {title} ".center(WIDTH, "-"))
        row(f"Mean {short} (ms):", summary[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", summary[f"median_{name}_ms"])
        for p in percentiles:
            label = percentile_label(p)
            row(f"P{label[1:]} {short} (ms):", summary[f"{label}_{name}_ms"])
    errors = error_counts(summary["errors"])
    if errors:
        lines.append(" Errors ".center(WIDTH, "-"))
        for message, count in errors[:max_errors]:
            lines.append(f"{count:>5} x {message}")
        if len(errors) > max_errors:
            lines.append(f"  ... and {len(errors) - max_errors} other distinct errors")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(summaries: Sequence[Mapping[str, Any]], *, percentile: float) -> str:
    """One row per request rate: what was offered against what was delivered."""
    label = percentile_label(percentile)
    header = (
        f"{'rate':>8} {'req/s':>8} {'goodput':>8} {'out tok/s':>10} {'failed':>7} "
        f"{label + ' TTFT':>11} {label + ' TPOT':>11} {label + ' E2EL':>11}"
    )
    lines = [" Request Rate Sweep (latencies in ms) ".center(len(header), "="), header]
    for s in summaries:
        goodput = "-" if s.get("request_goodput") is None else f"{s['request_goodput']:.2f}"
        # A latency left out of --percentile-metrics shows as "-".
        tails = [s.get(f"{label}_{m}_ms") for m in ("ttft", "tpot", "e2el")]
        ttft, tpot, e2el = ("-" if v is None else f"{v:.1f}" for v in tails)
        lines.append(
            f"{format_rate(float(s['request_rate'])):>8} {s['request_throughput']:>8.2f} {goodput:>8} "
            f"{s['output_throughput']:>10.1f} {s['failed']:>7} {ttft:>11} {tpot:>11} {e2el:>11}"
        )
    return "\n".join(lines)
