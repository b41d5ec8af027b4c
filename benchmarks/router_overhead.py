"""What the router adds to time to first token (CPU, embedded model): one replica (`tokenmill serve`) and
a cache_aware router in front of it; the same streamed chat request (a cached ~570-token prompt, one
output token) sent alternately to the replica and through the router, one at a time. Prints one JSON
document: median and P90 TTFT of each path and the difference, and the router's own decision time.

    python benchmarks/router_overhead.py [--requests 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.entrypoints.openai.conftest import MAIN_SERVER_ARGS, ServerProcess, wait_for  # noqa: E402
from tests.router.test_router import conversation  # noqa: E402


def first_token_s(client: httpx.Client, url: str, body: dict) -> float:
    start = time.perf_counter()
    with client.stream("POST", url, json=body) as response:
        chunks = response.iter_raw()
        next(chunks)
        elapsed = time.perf_counter() - start
        for _chunk in chunks:
            pass
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200, help="requests on each path")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    logs = Path("/tmp/tokenmill-router-overhead")
    logs.mkdir(exist_ok=True)
    replica = ServerProcess(MAIN_SERVER_ARGS, logs / "replica.log").wait_ready()
    router = ServerProcess(
        ["--backend", replica.url, "--model", "default"], logs / "router.log", subcommand="router"
    )
    try:
        router.wait_ready(timeout=120)
        assert wait_for(lambda: httpx.get(f"{router.url}/health").status_code == 200)
        body = {"model": "default", "messages": conversation(0), "max_tokens": 1, "stream": True}
        paths = {
            "direct": f"{replica.url}/v1/chat/completions",
            "routed": f"{router.url}/v1/chat/completions",
        }
        samples: dict[str, list[float]] = {name: [] for name in paths}
        with httpx.Client(timeout=60) as client:
            for _ in range(10):  # warm-up: the prompt cached, both connections open
                for url in paths.values():
                    first_token_s(client, url, body)
            for _ in range(args.requests):
                for name, url in paths.items():
                    samples[name].append(first_token_s(client, url, body))
        metrics = router.metrics()
    finally:
        router.stop()
        replica.stop()

    def summary(values: list[float]) -> dict:
        ordered = sorted(values)
        return {
            "median_ms": statistics.median(values) * 1e3,
            "p90_ms": ordered[int(0.9 * len(ordered))] * 1e3,
        }

    report = {
        "requests_per_path": args.requests,
        "direct": summary(samples["direct"]),
        "routed": summary(samples["routed"]),
        "router_decision_mean_ms": metrics["tokenmill:router_decision_seconds_sum"]
        / metrics["tokenmill:router_decision_seconds_count"]
        * 1e3,
    }
    report["added_median_ms"] = report["routed"]["median_ms"] - report["direct"]["median_ms"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
