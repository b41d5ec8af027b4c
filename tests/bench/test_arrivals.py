"""Arrival schedules: the right mean rate, the right burstiness, exact constant spacing, trace replay."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.arrivals import (
    arrival_offsets,
    parse_request_rates,
    resolve_arrival_process,
    trace_offsets,
)


@pytest.mark.parametrize("rate", [0.5, 8.0, 200.0])
def test_poisson_arrivals_have_the_requested_mean_rate(rate: float) -> None:
    offsets = arrival_offsets(20_001, rate, process="poisson", seed=3)
    gaps = np.diff([0.0, *offsets])
    assert offsets[0] > 0.0 and np.all(gaps >= 0)
    # 20,000 exponential gaps: the mean is within 2% of 1/rate with overwhelming probability.
    assert 1 / gaps.mean() == pytest.approx(rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)  # exponential: CV = 1
    counts = np.bincount((np.asarray(offsets) * rate / 10).astype(int))[
        :-1
    ]  # windows of 10 expected arrivals
    assert counts.var() / counts.mean() == pytest.approx(1.0, rel=0.1)  # Poisson counts: variance = mean


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(burstiness: float) -> None:
    gaps = np.diff([0.0, *arrival_offsets(20_001, 10.0, process="gamma", burstiness=burstiness, seed=1)])
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


@pytest.mark.parametrize(("process", "burstiness"), [("poisson", 1.0), ("gamma", 0.3), ("gamma", 5.0)])
def test_the_last_arrival_is_at_n_over_rate_whatever_the_seed(process: str, burstiness: float) -> None:
    """vLLM rescales its drawn arrival times so that N requests at rate R span exactly N/R seconds,
    each after a gap (the first too): the offered load, and the request throughput of a server that keeps
    up, is R for any seed and any N (first at 0 and unscaled, 10 requests at 1/s had spanned 9 s +- 3)."""
    for seed in range(5):
        offsets = arrival_offsets(10, 2.0, process=process, burstiness=burstiness, seed=seed)
        assert offsets[-1] == pytest.approx(5.0) and 0.0 < offsets[0] <= offsets[1]
        assert np.all(np.diff(offsets) >= 0)
    assert arrival_offsets(10, 2.0, seed=0) != arrival_offsets(10, 2.0, seed=1)


def test_constant_and_infinite_rates() -> None:
    assert arrival_offsets(4, 4.0, process="constant") == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_offsets(0, 1.0) == []
    assert arrival_offsets(5, 2.0, seed=7) == arrival_offsets(5, 2.0, seed=7)
    with pytest.raises(ValueError, match="--request-rate"):
        arrival_offsets(3, 0.0)


def test_trace_replay_keeps_the_pacing_and_scales_it() -> None:
    assert trace_offsets([1000.0, 1500.0, 4000.0]) == pytest.approx([0.0, 0.5, 3.0])
    assert trace_offsets([1000.0, 1500.0, 4000.0], speedup=2.0) == pytest.approx([0.0, 0.25, 1.5])
    with pytest.raises(ValueError, match="--trace-speedup"):
        trace_offsets([0.0], speedup=0.0)


def test_rate_lists_and_process_resolution() -> None:
    assert parse_request_rates("1, 2,4.5,inf") == [1.0, 2.0, 4.5, math.inf]
    for bad in ("fast", "0", "-1", "1,,2"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_request_rates(bad)
    assert resolve_arrival_process(None, 1.0) == "poisson"
    assert resolve_arrival_process(None, 0.5) == "gamma"
    assert resolve_arrival_process("constant", 1.0) == "constant"
    with pytest.raises(ValueError, match="--burstiness"):
        resolve_arrival_process("poisson", 0.5)
    with pytest.raises(ValueError, match="--burstiness"):
        resolve_arrival_process(None, 0.0)
