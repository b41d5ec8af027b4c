"""Engine-reported prefix-cache counters of replicas, for router_x2.sh.

engine_hits.py URL [URL ...]                                   counters now, as JSON
engine_hits.py URL [URL ...] --since BEFORE.json --into RESULT.json
                               add the hit rate since BEFORE to a bench result
engine_hits.py --summarise RESULT.json [...]                   one row per policy and rate
"""

from __future__ import annotations

import argparse
import json
import re
import urllib.request
from pathlib import Path


def counters(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    values = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key in values:
            if line.startswith(f"tokenmill:prefix_cache_{key}_total"):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("items", nargs="*", help="replica URLs, or result files with --summarise")
    parser.add_argument("--since")
    parser.add_argument("--into")
    parser.add_argument("--summarise", action="store_true")
    args = parser.parse_args()
    if args.summarise:
        rows = []
        for path in args.items:
            match = re.search(r"router_(\w+?)_([\d.]+)\.json$", path)
            result = json.loads(Path(path).read_text())
            rows.append({
                "policy": match.group(1), "rate": float(match.group(2)),
                "request_throughput": result["request_throughput"],
                "output_throughput": result["output_throughput"],
                "median_ttft_ms": result["median_ttft_ms"], "p99_ttft_ms": result["p99_ttft_ms"],
                "engine_prefix_hit_rate": result.get("engine_prefix_hit_rate"), "failed": result["failed"],
            })  # fmt: skip
        print(json.dumps(sorted(rows, key=lambda r: (r["rate"], r["policy"])), indent=2))
        return
    now = {url: counters(url) for url in args.items}
    if args.since is None:
        print(json.dumps(now))
        return
    before = json.loads(Path(args.since).read_text())
    hits = sum(now[u]["hits"] - before[u]["hits"] for u in now)
    queries = sum(now[u]["queries"] - before[u]["queries"] for u in now)
    result = json.loads(Path(args.into).read_text())
    result.update(engine_prefix_hits=hits, engine_prefix_queries=queries,
                  engine_prefix_hit_rate=hits / queries if queries else None)  # fmt: skip
    Path(args.into).write_text(json.dumps(result))
    print(f"engine prefix hit rate: {result['engine_prefix_hit_rate']}")


if __name__ == "__main__":
    main()
