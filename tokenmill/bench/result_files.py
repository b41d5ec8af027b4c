"""Where `bench serve` writes its results: vLLM's --save-result files (one JSON object per run, named
and trimmed as `vllm bench serve` does) beside tokenmill's --output-json (every run in one file)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import PER_REQUEST_KEYS


def parse_key_values(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    """`["a=1", "b = x=y"]` -> {"a": "1", "b": "x=y"}, for --header and --metadata."""
    pairs: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} takes KEY=VALUE pairs, got {item!r}")
        pairs[key.strip()] = value.strip()
    return pairs


def result_path(
    *,
    label: str,
    rate: float | str,
    max_concurrency: int | None,
    model_id: str,
    date: str,
    result_dir: str | None,
    result_filename: str | None,
) -> Path:
    """vLLM's name, `{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json` (the rate as Python prints
    a float: 4.0, inf), unless --result-filename names the file; under --result-dir when given."""
    if result_filename:
        name = result_filename
    else:
        rate_text = rate if isinstance(rate, str) else str(float(rate))
        concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
        name = f"{label}-{rate_text}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    return Path(result_dir) / name if result_dir else Path(name)


def save_result(summary: Mapping[str, Any], path: Path, *, detailed: bool, append: bool) -> None:
    """Write one run as vLLM does: without the per-request lists unless `detailed`; with `append`, after
    what the file holds, one JSON object a line."""
    payload = dict(summary) if detailed else {k: v for k, v in summary.items() if k not in PER_REQUEST_KEYS}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+" if append else "w", encoding="utf-8") as file:
        if append and file.tell() != 0:
            file.write("\n")
        json.dump(payload, file)
