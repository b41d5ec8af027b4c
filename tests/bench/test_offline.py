"""`bench throughput` and `bench latency`: the arithmetic against a timed stand-in, then the real engine."""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import tokenmill

from .test_cli import _parse

PREFILL_S = 0.03
DECODE_STEP_S = 0.004


class TimedLLM:
    """Takes PREFILL_S for the batch's first token and DECODE_STEP_S for each later one."""

    instances: list[TimedLLM] = []

    def __init__(self, **engine_args: object) -> None:
        self.engine_args = engine_args
        self.calls: list[tuple[list[list[int]], list]] = []
        TimedLLM.instances.append(self)

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm=True):
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompt_token_ids)
        )
        self.calls.append((prompt_token_ids, params))
        max_tokens = max(p.max_tokens for p in params)
        time.sleep(PREFILL_S + DECODE_STEP_S * (max_tokens - 1))
        return [
            SimpleNamespace(prompt_token_ids=ids, outputs=[SimpleNamespace(token_ids=[7] * p.max_tokens)])
            for ids, p in zip(prompt_token_ids, params, strict=True)
        ]


@pytest.fixture
def timed_llm(monkeypatch: pytest.MonkeyPatch) -> type[TimedLLM]:
    TimedLLM.instances = []
    monkeypatch.setattr(tokenmill, "LLM", TimedLLM, raising=False)
    return TimedLLM


def _run(argv: list[str]) -> int:
    args: argparse.Namespace = _parse(argv)
    return args.func(args)


def test_throughput_hands_every_request_over_at_once(
    timed_llm, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    argv = ["throughput", "--model", "m", "--tokenizer", str(tiny_tokenizer_path), "--num-prompts", "5",
            "--input-len", "12", "--output-len", "6", "--max-num-seqs", "4", "--output-json", str(out),
            "--disable-tqdm", "--num-warmups", "2"]  # fmt: skip
    assert _run(argv) == 0
    (llm,) = timed_llm.instances
    assert llm.engine_args == {
        "model": "m",
        "load_format": "auto",
        "dtype": "auto",
        "seed": 0,
        "max_num_seqs": 4,
    }
    (warm_prompts, warm_params), (prompts, params) = llm.calls
    # The warm-up runs the first prompts at full length, untimed; the timed call hands over all of them.
    assert warm_prompts == prompts[:2] and all(p.max_tokens == 4 for p in warm_params)
    assert [len(p) for p in prompts] == [12] * 5
    assert all(p.ignore_eos and p.max_tokens == 6 for p in params)
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["total_input_tokens"], result["total_output_tokens"]) == (
        5,
        60,
        30,
    )
    assert result["total_num_tokens"] == 90
    elapsed = result["elapsed_time"]
    assert elapsed == pytest.approx(PREFILL_S + 5 * DECODE_STEP_S, abs=0.02)
    assert result["requests_per_second"] == pytest.approx(5 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(30 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(90 / elapsed)


def test_latency_separates_ttft_from_decode_steps(
    timed_llm, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "l.json"
    argv = ["latency", "--model", "m", "--tokenizer", str(tiny_tokenizer_path), "--batch-size", "3",
            "--input-len", "5", "--output-len", "11", "--num-iters-warmup", "1", "--num-iters", "3",
            "--output-json", str(out)]  # fmt: skip
    assert _run(argv) == 0
    (llm,) = timed_llm.instances
    assert len(llm.calls) == 1 + 2 * 3  # warm-up, then first-token and full runs per iteration
    assert all(len(prompts) == 3 and all(len(p) == 5 for p in prompts) for prompts, _ in llm.calls)
    result = json.loads(out.read_text())
    assert result["ttft_ms"]["mean"] == pytest.approx(PREFILL_S * 1e3, abs=8.0)
    assert result["decode_step_ms"]["median"] == pytest.approx(DECODE_STEP_S * 1e3, abs=1.5)
    assert result["avg_latency"] == pytest.approx(PREFILL_S + 10 * DECODE_STEP_S, abs=0.01)
    assert len(result["latencies"]) == 3 and set(result["percentiles"]) == {
        "10",
        "25",
        "50",
        "75",
        "90",
        "99",
    }
    assert result["decode_tokens_per_second"] == pytest.approx(3 / (result["decode_step_ms"]["mean"] / 1e3))


def test_latency_rejects_empty_shapes(timed_llm) -> None:
    with pytest.raises(ValueError, match="--batch-size"):
        _run(["latency", "--batch-size", "0", "--tokenizer", "default"])


def test_throughput_and_latency_on_the_real_engine(
    hf_model_dirs, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    model_dir = hf_model_dirs["llama"][0]
    common = [
        "--model",
        model_dir,
        "--tokenizer",
        str(tiny_tokenizer_path),
        "--max-model-len",
        "64",
        "--skip-tokenizer-init",
    ]
    assert _run(["throughput", *common, "--num-prompts", "4", "--input-len", "10", "--output-len", "5",
                 "--output-json", str(tmp_path / "t.json"), "--disable-tqdm"]) == 0  # fmt: skip
    throughput = json.loads((tmp_path / "t.json").read_text())
    assert (throughput["total_input_tokens"], throughput["total_output_tokens"]) == (40, 20)
    latency_argv = shlex.split(
        "--batch-size 2 --input-len 6 --output-len 4 --num-iters-warmup 1 --num-iters 2"
    )
    assert _run(["latency", *common, *latency_argv, "--output-json", str(tmp_path / "l.json")]) == 0
    latency = json.loads((tmp_path / "l.json").read_text())
    # Timing itself is checked against the stand-in above; here only that the real engine runs through.
    assert len(latency["ttfts"]) == len(latency["decode_step_latencies"]) == len(latency["latencies"]) == 2
