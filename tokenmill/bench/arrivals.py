"""When each request is sent: Poisson, gamma (bursty) or constant-rate schedules, and trace replay."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ARRIVAL_PROCESSES = ("poisson", "gamma", "constant")


def resolve_arrival_process(process: str | None, burstiness: float) -> str:
    """Default as vLLM does: gamma arrivals shaped by --burstiness, which is Poisson at 1.0."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if process is None:
        return "poisson" if burstiness == 1.0 else "gamma"
    if process not in ARRIVAL_PROCESSES:
        raise ValueError(f"--arrival-process must be one of {', '.join(ARRIVAL_PROCESSES)}, got {process!r}")
    if process != "gamma" and burstiness != 1.0:
        raise ValueError(
            "--burstiness applies to gamma arrivals only; drop it or use --arrival-process gamma"
        )
    return process


def arrival_offsets(
    num_requests: int,
    request_rate: float,
    *,
    process: str = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Send times in seconds after the start, non-decreasing: the process's `num_requests` arrivals, the
    first also after one gap, as vLLM schedules them.

    Gaps are drawn from a gamma distribution with shape `burstiness` and mean 1/rate: shape 1 is a
    Poisson process, below 1 burstier, above 1 more regular. As vLLM does, the drawn times are rescaled
    so that the last arrival is at exactly num_requests / rate: the offered load is the rate whatever
    the seed, and a server that keeps up shows a request throughput of the rate. `constant` spaces
    requests exactly 1/rate. An infinite rate sends everything at once.
    """
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if process == "constant":
        return (np.arange(1, num_requests + 1) / request_rate).tolist()
    shape = burstiness if process == "gamma" else 1.0
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.gamma(shape, 1.0 / (request_rate * shape), num_requests))
    return (times * (num_requests / request_rate / times[-1])).tolist()


def trace_offsets(timestamps_ms: Sequence[float], speedup: float = 1.0) -> list[float]:
    """Replay a trace's own pacing: offsets in seconds from its first timestamp, divided by `speedup`."""
    if speedup <= 0:
        raise ValueError(f"--trace-speedup must be > 0, got {speedup}")
    if not timestamps_ms:
        return []
    first = min(timestamps_ms)
    return [(t - first) / 1000.0 / speedup for t in timestamps_ms]


def parse_request_rates(text: str) -> list[float]:
    """`--request-rate 1,2,4,inf` -> [1.0, 2.0, 4.0, inf]; each must be > 0."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise ValueError(
                f"--request-rate takes numbers or inf separated by commas, got {text!r}"
            ) from None
        if not rate > 0:
            raise ValueError(f"--request-rate values must be > 0 (or inf), got {part.strip()!r}")
        rates.append(rate)
    return rates
