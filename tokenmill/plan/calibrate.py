"""Measured against planned: read a benchmark result (vLLM's key names, as `tokenmill bench` writes them)
and express its TPOT, output throughput and TTFT as fractions of the roofline at the measured concurrency."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from tokenmill.plan.roofline import RooflinePoint


class BenchResult(NamedTuple):
    model: str | None
    gpu: str | None
    input_len: int
    output_len: int
    concurrency: float
    concurrency_source: str
    mean_tpot_ms: float
    median_tpot_ms: float | None
    mean_ttft_ms: float
    output_throughput: float

    @property
    def batch(self) -> int:
        return max(1, round(self.concurrency))

    @property
    def decode_context_len(self) -> int:
        """Mean KV length a sequence attends to over its decode phase."""
        return self.input_len + self.output_len // 2


def read_bench_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read benchmark result {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"cannot read benchmark result {path}: not valid JSON ({exc})") from exc
    if isinstance(data, list):
        raise ValueError(
            f"{path} holds {len(data)} results (a rate sweep's): calibrate from one of them, e.g. "
            f"jq '.[-1]' {path} > one.json"
        )
    if not isinstance(data, dict):
        raise ValueError(f"cannot read benchmark result {path}: expected a JSON object")
    return data


def _number(data: dict[str, Any], key: str) -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"benchmark result: {key!r} must be a finite number, got {value!r}")
    return float(value)


def _mean_length(data: dict[str, Any], fixed_key: str, total_key: str) -> int:
    """Per-request length: the configured random length, else the total over the completed requests."""
    fixed = _number(data, fixed_key)
    if fixed is not None and fixed > 0:
        return int(fixed)
    total, completed = _number(data, total_key), _number(data, "completed")
    if total is not None and completed:
        return max(1, round(total / completed))
    raise ValueError(f"benchmark result has neither {fixed_key!r} nor {total_key!r} with 'completed'")


def parse_bench_result(data: dict[str, Any], batch: int | None = None) -> BenchResult:
    """Pull what calibration needs. The concurrency is `batch` if given, else Little's law
    (request throughput x mean end-to-end latency) capped by max_concurrency, else max_concurrency."""
    required = {key: _number(data, key) for key in ("mean_tpot_ms", "mean_ttft_ms", "output_throughput")}
    missing = [key for key, value in required.items() if value is None]
    if missing:
        raise ValueError(f"benchmark result lacks {', '.join(missing)}")
    input_len = _mean_length(data, "random_input_len", "total_input_tokens")
    output_len = _mean_length(data, "random_output_len", "total_output_tokens")
    mean_tpot_ms, mean_ttft_ms = required["mean_tpot_ms"], required["mean_ttft_ms"]
    assert mean_tpot_ms is not None and mean_ttft_ms is not None
    max_concurrency = _number(data, "max_concurrency")
    request_throughput = _number(data, "request_throughput")
    e2el_ms = _number(data, "mean_e2el_ms")
    if e2el_ms is None:
        e2el_ms = mean_ttft_ms + mean_tpot_ms * (output_len - 1)
    if batch is not None:
        concurrency, source = float(batch), "--batch"
    elif request_throughput:
        concurrency, source = request_throughput * e2el_ms / 1e3, "Little's law"
        if max_concurrency and concurrency > max_concurrency:
            concurrency, source = max_concurrency, "max_concurrency"
    elif max_concurrency:
        concurrency, source = max_concurrency, "max_concurrency"
    else:
        raise ValueError(
            "benchmark result gives neither request_throughput nor max_concurrency; pass --batch"
        )
    model = data.get("model") or data.get("model_id")
    gpu = data.get("gpu")
    return BenchResult(
        model=str(model) if model else None,
        gpu=str(gpu) if gpu else None,
        input_len=input_len,
        output_len=output_len,
        concurrency=concurrency,
        concurrency_source=source,
        mean_tpot_ms=mean_tpot_ms,
        median_tpot_ms=_number(data, "median_tpot_ms"),
        mean_ttft_ms=mean_ttft_ms,
        output_throughput=required["output_throughput"] or 0.0,
    )


class CalibrationRow(NamedTuple):
    metric: str
    unit: str
    measured: float
    roofline: float  # the floor for times, the ceiling for throughputs
    fraction: float  # of the roofline: 1.0 would be running at the physical limit


def _row(metric: str, unit: str, measured: float, roofline: float) -> CalibrationRow:
    # A throughput is measured against a ceiling (higher is better); a latency against a floor.
    if measured <= 0:
        return CalibrationRow(metric, unit, measured, roofline, 0.0)
    fraction = measured / roofline if unit == "tok/s" else roofline / measured
    return CalibrationRow(metric, unit, measured, roofline, fraction)


def calibration_rows(
    result: BenchResult, decode: RooflinePoint, prefill: RooflinePoint
) -> list[CalibrationRow]:
    tpot_floor_ms = decode.floor_s * 1e3
    rows = [_row("mean TPOT", "ms", result.mean_tpot_ms, tpot_floor_ms)]
    if result.median_tpot_ms is not None:
        rows.append(_row("median TPOT", "ms", result.median_tpot_ms, tpot_floor_ms))
    rows.append(_row("output throughput", "tok/s", result.output_throughput, decode.tok_s_aggregate))
    rows.append(_row("mean TTFT", "ms", result.mean_ttft_ms, prefill.floor_s * 1e3))
    return rows


def format_calibration(title: str, result: BenchResult, rows: list[CalibrationRow]) -> str:
    lines = [
        title,
        f"measured concurrency {result.concurrency:.1f} ({result.concurrency_source}), planned at batch "
        f"{result.batch}; input {result.input_len:,} and output {result.output_len:,} tokens per request, "
        f"decode attending to {result.decode_context_len:,} cached tokens on average",
        "",
        f"  {'metric':<20}{'measured':>16}{'roofline':>16}{'fraction of roofline':>24}",
    ]
    for row in rows:
        measured, roofline = f"{row.measured:,.2f} {row.unit}", f"{row.roofline:,.2f} {row.unit}"
        lines.append(f"  {row.metric:<20}{measured:>16}{roofline:>16}{row.fraction:>23.1%}")
    if any(row.fraction > 1 for row in rows):
        lines.append(
            "note: a measurement beats the roofline: check the GPU, dtypes, TP degree and lengths given"
        )
    lines.append(
        "note: TTFT under load includes queueing and shares steps with decode; the floor is one prompt alone"
    )
    return "\n".join(lines)
