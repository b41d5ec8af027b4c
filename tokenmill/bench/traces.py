"""Requests from a JSONL file: prompts as written, or Mooncake-style traces of input lengths and shared
block hashes, replayed at their timestamps."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from tokenmill.bench.prompts import PromptMaker, SampleRequest
from tokenmill.bench.tokenizer import BenchTokenizer

# Mooncake-style traces name each 512-token block of a prompt by a hash id.
TRACE_BLOCK_TOKENS = 512


def file_requests(
    path: str | Path,
    tokenizer: BenchTokenizer | None,
    *,
    num_prompts: int | None = None,
    default_output_len: int = 128,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """A JSONL file, one request per line, in file order (a trace is sorted by its timestamps).

    Keys: `prompt` (text or token ids) or `input_length` (random tokens, shared per `hash_ids`
    block as in Mooncake traces); `output_length`/`max_tokens` (else `default_output_len`);
    `timestamp` in milliseconds to replay the trace's pacing.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: cannot read it ({exc.strerror or exc})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ValueError(f"--dataset-path {path} holds no requests")
    records = [_parse_line(line, path, number) for number, line in enumerate(lines, start=1)]
    if num_prompts and num_prompts > len(records):
        print(f"--dataset-path {path} holds {len(records)} requests; sending those", file=sys.stderr)
    records = records[:num_prompts] if num_prompts else records
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng) if tokenizer is not None else None
    blocks: dict[object, list[int]] = {}
    requests = []
    for record in records:
        output_len = int(record.get("output_length", record.get("max_tokens", default_output_len)))
        prompt, prompt_len = _record_prompt(record, tokenizer, maker, blocks, as_token_ids, path)
        timestamp = record.get("timestamp")
        requests.append(SampleRequest(prompt, prompt_len, output_len, _float_or_none(timestamp)))
    if any(r.timestamp_ms is not None for r in requests):
        if any(r.timestamp_ms is None for r in requests):
            raise ValueError(f"--dataset-path {path}: either every line has a timestamp or none does")
        requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def _record_prompt(
    record: dict,
    tokenizer: BenchTokenizer | None,
    maker: PromptMaker | None,
    blocks: dict[object, list[int]],
    as_token_ids: bool,
    path: str | Path,
) -> tuple[str | list[int], int]:
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, list):
            return [int(t) for t in prompt], len(prompt)
        if as_token_ids and tokenizer is not None:
            ids = tokenizer.encode(prompt)
            return ids, len(ids)
        return prompt, len(tokenizer.encode(prompt)) if tokenizer is not None else 0
    if maker is None:
        raise ValueError(f"--dataset-path {path} gives input_length without prompts; pass --tokenizer")
    input_len = int(record["input_length"])
    ids: list[int] = []
    for hash_id in record.get("hash_ids", []):
        if hash_id not in blocks:
            blocks[hash_id] = maker.random_ids(TRACE_BLOCK_TOKENS)
        ids += blocks[hash_id]
    ids = ids[:input_len] + maker.random_ids(max(0, input_len - len(ids)))
    return maker.prompt(ids, as_token_ids)


def _parse_line(line: str, path: str | Path, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--dataset-path {path}, line {number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict) or not ("prompt" in record or "input_length" in record):
        raise ValueError(f"--dataset-path {path}, line {number}: needs a 'prompt' or an 'input_length'")
    return record


def _float_or_none(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]
