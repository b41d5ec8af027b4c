"""Drop per-request arrays (ttfts, itls, ...: lists longer than 64) from bench JSON files in place, so
results fit what the device machine sends back and what the repository keeps.
Usage: python benchmarks/gpu/strip_results.py FILE.json ..."""

from __future__ import annotations

import json
import sys


def strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if not (isinstance(v, list) and len(v) > 64)}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            data = json.load(f)
        with open(path, "w") as f:
            json.dump(strip(data), f, indent=1)
