"""summarize() on hand-made request results: exact values under vLLM's key names."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.bench.client import RequestResult
from tokenmill.bench.metrics import (
    error_counts,
    meets_slos,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    percentile_label,
    summarize,
)


def _ok(
    start: float, ttft: float, itl: list[float], output_tokens: int, prompt_len: int = 10
) -> RequestResult:
    latency = ttft + sum(itl)
    return RequestResult(
        success=True,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=latency,
        prompt_len=prompt_len,
        output_tokens=output_tokens,
    )


RESULTS = [
    _ok(0.0, 0.100, [0.02, 0.02, 0.02], 4),  # E2EL 0.16, TPOT 0.02
    _ok(0.5, 0.200, [0.04, 0.06], 3),  # E2EL 0.30, TPOT 0.05
    _ok(1.2, 0.300, [], 1, prompt_len=20),  # one token: no TPOT, no ITL
    RequestResult(success=False, start_time=1.5, prompt_len=10, error="HTTP 500: boom"),
]


def test_summary_has_vllm_keys_and_exact_values() -> None:
    summary = summarize(RESULTS, 2.0, percentiles=[50, 99.9])
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["duration"] == 2.0
    assert summary["total_input_tokens"] == 40  # failed requests' prompts are not counted
    assert summary["total_output_tokens"] == 8
    assert summary["request_throughput"] == pytest.approx(1.5)
    assert summary["output_throughput"] == pytest.approx(4.0)
    assert summary["total_token_throughput"] == pytest.approx(24.0)
    assert summary["request_goodput"] is None

    assert summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert summary["median_ttft_ms"] == pytest.approx(200.0)
    assert summary["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    assert summary["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300], 99.9))
    assert summary["mean_tpot_ms"] == pytest.approx(35.0)  # (20 + 50) / 2; the 1-token answer has none
    assert summary["mean_itl_ms"] == pytest.approx(np.mean([20, 20, 20, 40, 60]))
    assert summary["p50_itl_ms"] == pytest.approx(20.0)
    assert summary["mean_e2el_ms"] == pytest.approx(np.mean([160, 300, 300]))

    assert summary["errors"] == ["", "", "", "HTTP 500: boom"]
    assert summary["input_lens"] == [10, 10, 20, 10]
    assert summary["output_lens"] == [4, 3, 1, 0]
    assert summary["tpots"] == [pytest.approx(0.02), pytest.approx(0.05), None, None]
    assert summary["itls"][1] == [0.04, 0.06]


def test_peak_concurrency_and_peak_output_rate() -> None:
    overlapping = [_ok(0.0, 0.5, [0.5], 2), _ok(0.2, 0.1, [0.1], 2), _ok(0.9, 0.05, [0.05], 2)]
    summary = summarize(overlapping, 1.0)
    # [0, 1.0], [0.2, 0.4], [0.9, 1.0]: two at once at most.
    assert summary["max_concurrent_requests"] == 2
    # Chunks at 0.5, 1.0, 0.3, 0.4, 0.95, 1.0 -> second 0 holds 4 tokens, second 1 holds 2.
    assert summary["max_output_tokens_per_s"] == pytest.approx(4.0)


def test_goodput_counts_requests_meeting_every_objective() -> None:
    summary = summarize(RESULTS, 2.0, goodput_slos_ms={"ttft": 250.0, "tpot": 30.0})
    assert summary["request_goodput"] == pytest.approx(0.5)  # only the first: TTFT 100, TPOT 20
    one_token = RESULTS[2]
    assert meets_slos(one_token, {"tpot": 1.0})  # no TPOT to miss
    assert not meets_slos(one_token, {"e2el": 299.0})


def test_no_completed_request_gives_zeros_not_nans() -> None:
    summary = summarize([RESULTS[3]], 1.0, goodput_slos_ms={"ttft": 1.0})
    assert summary["completed"] == 0 and summary["request_goodput"] == 0.0
    assert summary["mean_ttft_ms"] == 0.0 and summary["p99_itl_ms"] == 0.0
    assert summary["max_output_tokens_per_s"] == 0.0 and summary["max_concurrent_requests"] == 0


def test_parsers_and_labels() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 2000.5,
    }
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError, match="--metric-percentiles"):
        parse_percentiles("101")
    assert parse_metric_names("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError, match="--percentile-metrics"):
        parse_metric_names("ttft,latency")
    assert [percentile_label(p) for p in (99, 99.0, 99.9, 50)] == ["p99", "p99", "p99.9", "p50"]
    assert error_counts(["", "b", "a", "b"]) == [("b", 2), ("a", 1)]
