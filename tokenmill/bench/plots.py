"""PNG pictures of a run: latency CDFs, and for a rate sweep, throughput and tail latency vs rate."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from tokenmill.bench.metrics import percentile_label  # noqa: E402

_PANELS = (
    ("ttft", "TTFT (ms)"),
    ("tpot", "TPOT (ms)"),
    ("itl", "ITL (ms)"),
    ("e2el", "E2E latency (ms)"),
)


def write_plots(
    summaries: Sequence[Mapping[str, Any]],
    directory: Path,
    *,
    slos_ms: Mapping[str, float],
    percentile: float,
) -> list[Path]:
    """Write latency_cdf.png, and for several rates also throughput_vs_rate.png and latency_vs_rate.png."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--plot {directory}: cannot make the directory ({exc.strerror or exc})") from None
    paths = [plot_latency_cdfs(summaries, directory / "latency_cdf.png", slos_ms=slos_ms)]
    if len(summaries) > 1:
        paths.append(plot_throughput_vs_rate(summaries, directory / "throughput_vs_rate.png"))
        paths.append(
            plot_latency_vs_rate(
                summaries, directory / "latency_vs_rate.png", slos_ms=slos_ms, percentile=percentile
            )
        )
    return paths


def latency_samples_ms(summary: Mapping[str, Any], metric: str) -> np.ndarray:
    """One metric's samples (ms) over the completed requests of a run, from its JSON lists."""
    ok = [not error for error in summary["errors"]]
    if metric == "itl":
        values = [gap for good, gaps in zip(ok, summary["itls"], strict=True) if good for gap in gaps]
    else:
        column = {"ttft": "ttfts", "tpot": "tpots", "e2el": "latencies"}[metric]
        values = [v for good, v in zip(ok, summary[column], strict=True) if good and v is not None]
    return np.sort(np.asarray(values, dtype=np.float64) * 1e3)


def plot_latency_cdfs(
    summaries: Sequence[Mapping[str, Any]], path: Path, *, slos_ms: Mapping[str, float]
) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (metric, label) in zip(axes.flat, _PANELS, strict=True):
        for summary in summaries:
            values = latency_samples_ms(summary, metric)
            if values.size:
                fraction = np.arange(1, values.size + 1) / values.size
                ax.step(values, fraction, where="post", label=f"rate {_rate_label(summary)}")
        if metric in slos_ms:
            ax.axvline(slos_ms[metric], color="crimson", linestyle="--", linewidth=1.2, label="SLO")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    first = summaries[0]
    fig.suptitle(f"Latency CDFs: {first.get('model_id', '')}, {first.get('completed', 0)} requests per rate")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput_vs_rate(summaries: Sequence[Mapping[str, Any]], path: Path) -> Path:
    x, labels = _rate_positions(summaries)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ax.plot(x, [s["request_throughput"] for s in summaries], "o-", label="achieved requests/s")
    if all(s.get("request_goodput") is not None for s in summaries):
        ax.plot(
            x,
            [s["request_goodput"] for s in summaries],
            "s--",
            color="tab:green",
            label="goodput requests/s (met SLOs)",
        )
    finite = [
        (xi, float(s["request_rate"])) for xi, s in zip(x, summaries, strict=True) if _is_finite_rate(s)
    ]
    if finite:
        ax.plot(*zip(*finite, strict=True), ":", color="gray", label="offered rate")
    ax.set_xlabel("offered request rate (requests/s)")
    ax.set_ylabel("requests/s")
    tokens_axis = ax.twinx()
    tokens_axis.plot(
        x, [s["output_throughput"] for s in summaries], "^-", color="darkorange", label="output tok/s"
    )
    tokens_axis.set_ylabel("output tokens/s", color="darkorange")
    _label_rates(ax, x, labels)
    handles = ax.get_legend_handles_labels()[0] + tokens_axis.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    ax.set_title("Throughput vs offered load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency_vs_rate(
    summaries: Sequence[Mapping[str, Any]], path: Path, *, slos_ms: Mapping[str, float], percentile: float
) -> Path:
    x, labels = _rate_positions(summaries)
    tail = percentile_label(percentile)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
        ax.plot(x, [s.get(f"{tail}_{metric}_ms", 0.0) for s in summaries], "o-", label=f"{tail.upper()}")
        ax.plot(x, [s.get(f"median_{metric}_ms", 0.0) for s in summaries], "o:", label="median")
        if metric in slos_ms:
            ax.axhline(slos_ms[metric], color="crimson", linestyle="--", linewidth=1.2, label="SLO")
        ax.set_xlabel("offered request rate (requests/s)")
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.set_title(f"{tail.upper()} {metric.upper()} vs rate")
        _label_rates(ax, x, labels)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _is_finite_rate(summary: Mapping[str, Any]) -> bool:
    try:
        return math.isfinite(float(summary["request_rate"]))
    except (TypeError, ValueError):
        return False


def _rate_label(summary: Mapping[str, Any]) -> str:
    rate = summary.get("request_rate", "inf")
    return f"{rate:g}" if isinstance(rate, int | float) else str(rate)


def _rate_positions(summaries: Sequence[Mapping[str, Any]]) -> tuple[list[float], list[str]]:
    """x positions on a log axis; an infinite rate sits one doubling past the largest finite one."""
    finite = [float(s["request_rate"]) for s in summaries if _is_finite_rate(s)]
    beyond = 2 * max(finite) if finite else 1.0
    positions = [float(s["request_rate"]) if _is_finite_rate(s) else beyond for s in summaries]
    return positions, [_rate_label(s) for s in summaries]


def _label_rates(ax: Any, positions: list[float], labels: list[str]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(positions)
    ax.set_xticklabels(labels)
    ax.minorticks_off()
