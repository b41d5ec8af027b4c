"""`bench throughput` and `bench latency`: the arithmetic against a timed stand-in, then the real engine."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

import tokenmill
from tokenmill.bench import offline

from .test_cli import _parse

PREFILL_S = 0.03
DECODE_STEP_S = 0.004


class FakeClock:
    """Stands in for `time` in the bench: the stand-ins advance it, so every timing is exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class TimedEngine:
    """Steps one batch at a time: its first tokens take PREFILL_S, each later step DECODE_STEP_S."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.batches: list[list[list[int]]] = []
        self.waiting: dict[str, tuple[list[int], int]] = {}
        self.running: dict[str, list[int]] = {}  # request id -> [tokens produced, max_tokens]

    def add_request(self, request_id: str, prompt: list[int], params) -> None:
        self.waiting[request_id] = (prompt, params.max_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[SimpleNamespace]:
        if self.waiting:
            self.clock.now += PREFILL_S
            self.batches.append([prompt for prompt, _ in self.waiting.values()])
            self.running = {rid: [0, max_tokens] for rid, (_, max_tokens) in self.waiting.items()}
            self.waiting = {}
        else:
            self.clock.now += DECODE_STEP_S
        outputs = []
        for request_id, progress in list(self.running.items()):
            progress[0] += 1
            finished = progress[0] == progress[1]
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished, num_cached_tokens=0))
            if finished:
                del self.running[request_id]
        return outputs


class TimedLLM:
    """`generate` takes PREFILL_S for the batch's first token and DECODE_STEP_S for each later one."""

    instances: list[TimedLLM] = []
    clock = FakeClock()

    def __init__(self, **engine_args: object) -> None:
        self.engine_args = engine_args
        self.calls: list[tuple[list[list[int]], list]] = []
        self.engine = TimedEngine(self.clock)
        TimedLLM.instances.append(self)

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm=True):
        params = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params] * len(prompt_token_ids)
        )
        self.calls.append((prompt_token_ids, params))
        max_tokens = max(p.max_tokens for p in params)
        self.clock.now += PREFILL_S + DECODE_STEP_S * (max_tokens - 1)
        return [
            SimpleNamespace(prompt_token_ids=ids, outputs=[SimpleNamespace(token_ids=[7] * p.max_tokens)])
            for ids, p in zip(prompt_token_ids, params, strict=True)
        ]


@pytest.fixture
def timed_llm(monkeypatch: pytest.MonkeyPatch) -> type[TimedLLM]:
    TimedLLM.instances = []
    TimedLLM.clock = FakeClock()
    monkeypatch.setattr(tokenmill, "LLM", TimedLLM, raising=False)
    monkeypatch.setattr(offline, "time", TimedLLM.clock)
    return TimedLLM


@pytest.fixture
def recording_llm(monkeypatch: pytest.MonkeyPatch) -> list:
    """The real engine, each one kept so a test can read its KV cache manager's counters afterwards."""
    instances = []

    class RecordingLLM(tokenmill.LLM):
        def __init__(self, **engine_args) -> None:
            super().__init__(**engine_args)
            instances.append(self)

    monkeypatch.setattr(tokenmill, "LLM", RecordingLLM, raising=False)
    return instances


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
    assert elapsed == pytest.approx(PREFILL_S + 5 * DECODE_STEP_S)
    assert result["requests_per_second"] == pytest.approx(5 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(30 / elapsed)
    assert result["tokens_per_second"] == pytest.approx(90 / elapsed)


def test_latency_times_prefill_and_decode_steps_within_one_run(
    timed_llm, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "l.json"
    argv = ["latency", "--model", "m", "--tokenizer", str(tiny_tokenizer_path), "--batch-size", "3",
            "--input-len", "5", "--output-len", "11", "--num-iters-warmup", "2", "--num-iters", "3",
            "--output-json", str(out)]  # fmt: skip
    assert _run(argv) == 0
    (llm,) = timed_llm.instances
    assert llm.engine_args["enable_prefix_caching"] is False
    # One batch per run, warm-up included, and never a prompt seen before: no prefix-cache hit possible.
    assert [len(batch) for batch in llm.engine.batches] == [3] * 5
    prompts = [tuple(p) for batch in llm.engine.batches for p in batch]
    assert all(len(p) == 5 for p in prompts) and len(set(prompts)) == 15
    result = json.loads(out.read_text())
    assert result["ttfts"] == pytest.approx([PREFILL_S] * 3)
    assert result["decode_step_latencies"] == pytest.approx([DECODE_STEP_S] * 3)
    assert result["latencies"] == pytest.approx([PREFILL_S + 10 * DECODE_STEP_S] * 3)
    assert result["avg_latency"] == pytest.approx(PREFILL_S + 10 * DECODE_STEP_S)
    assert result["ttft_ms"]["p99"] == pytest.approx(PREFILL_S * 1e3)
    assert result["decode_step_ms"]["median"] == pytest.approx(DECODE_STEP_S * 1e3)
    assert result["e2e_latency_ms"]["p90"] == pytest.approx((PREFILL_S + 10 * DECODE_STEP_S) * 1e3)
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert result["decode_tokens_per_second"] == pytest.approx(3 / DECODE_STEP_S)
    assert (result["enable_prefix_caching"], result["num_cached_prompt_tokens"]) == (False, 0)


def test_latency_of_one_output_token_has_no_decode_step(
    timed_llm, tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "l.json"
    argv = ["latency", "--model", "m", "--tokenizer", str(tiny_tokenizer_path), "--batch-size", "2",
            "--output-len", "1", "--num-iters-warmup", "0", "--num-iters", "2", "--enable-prefix-caching",
            "--output-json", str(out)]  # fmt: skip
    assert _run(argv) == 0
    (llm,) = timed_llm.instances
    assert llm.engine_args["enable_prefix_caching"] is True and len(llm.engine.batches) == 2
    result = json.loads(out.read_text())
    assert result["latencies"] == result["ttfts"] == pytest.approx([PREFILL_S] * 2)
    assert (result["decode_step_latencies"], result["decode_step_ms"]) == ([], {})
    assert result["decode_tokens_per_second"] is None


def test_latency_rejects_empty_shapes(timed_llm) -> None:
    with pytest.raises(ValueError, match="--batch-size"):
        _run(["latency", "--batch-size", "0", "--tokenizer", "default"])


def test_throughput_on_the_real_engine(hf_model_dirs, tiny_tokenizer_path: Path, tmp_path: Path) -> None:
    common = _real_engine_args(hf_model_dirs, tiny_tokenizer_path)
    assert _run(["throughput", *common, "--num-prompts", "4", "--input-len", "10", "--output-len", "5",
                 "--output-json", str(tmp_path / "t.json"), "--disable-tqdm"]) == 0  # fmt: skip
    throughput = json.loads((tmp_path / "t.json").read_text())
    assert (throughput["total_input_tokens"], throughput["total_output_tokens"]) == (40, 20)


@pytest.mark.parametrize("prefix_caching", [[], ["--enable-prefix-caching"]], ids=["default", "caching-on"])
def test_latency_on_the_real_engine_never_hits_the_prefix_cache(
    recording_llm, hf_model_dirs, tiny_tokenizer_path: Path, tmp_path: Path, prefix_caching: list[str]
) -> None:
    # 40-token prompts hold two full 16-token blocks each: a repeated prompt would be served from cache.
    argv = shlex.split("--batch-size 2 --input-len 40 --output-len 5 --num-iters-warmup 1 --num-iters 3")
    out = tmp_path / "l.json"
    common = _real_engine_args(hf_model_dirs, tiny_tokenizer_path)
    assert _run(["latency", *common, *argv, *prefix_caching, "--output-json", str(out)]) == 0
    (llm,) = recording_llm
    kv = llm.engine.scheduler.kv
    assert kv.prefix_cache_hits == 0
    # Looked up only with caching on, 4 runs of 2 prompts: each prompt has two full blocks, none ever hit.
    assert llm.config.enable_prefix_caching is bool(prefix_caching)
    assert kv.prefix_cache_queries == (4 * 2 * 40 if prefix_caching else 0)
    result = json.loads(out.read_text())
    assert result["num_cached_prompt_tokens"] == 0
    assert len(result["ttfts"]) == len(result["decode_step_latencies"]) == len(result["latencies"]) == 3
    # The prompt fits one step, so each run is its prefill then exactly 4 decode steps, all timed in it.
    for ttft, step, latency in zip(
        result["ttfts"], result["decode_step_latencies"], result["latencies"], strict=True
    ):
        assert 0 < ttft < latency and step > 0
        assert latency == pytest.approx(ttft + 4 * step, rel=1e-9)


def _real_engine_args(hf_model_dirs, tiny_tokenizer_path: Path) -> list[str]:
    model_dir = hf_model_dirs["llama"][0]
    return ["--model", model_dir, "--tokenizer", str(tiny_tokenizer_path), "--max-model-len", "64",
            "--skip-tokenizer-init"]  # fmt: skip


@pytest.mark.parametrize("command", ["throughput", "latency"])
def test_quantization_and_kv_cache_dtype_reach_the_engine(
    recording_llm, hf_model_dirs, tiny_tokenizer_path: Path, tmp_path: Path, command: str
) -> None:
    """vLLM's bench commands take every engine argument; these two had been refused as unrecognized."""
    import torch

    from tokenmill.layers.linear import LinearBase

    shape = ["--num-prompts", "2"] if command == "throughput" else ["--batch-size", "2", "--num-iters", "1"]
    argv = [command, *_real_engine_args(hf_model_dirs, tiny_tokenizer_path), *shape, "--input-len", "8",
            "--output-len", "3", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
            "--output-json", str(tmp_path / "r.json")]  # fmt: skip
    assert _run(argv) == 0
    (llm,) = recording_llm
    assert (llm.config.quantization, llm.config.kv_cache_dtype) == ("fp8", "fp8")
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == torch.float8_e4m3fn for m in linears)
