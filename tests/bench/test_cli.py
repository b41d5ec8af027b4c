"""`tokenmill bench serve` end to end against the fake server: report, JSON with vLLM keys, PNGs."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import time
from pathlib import Path

import pytest

from tokenmill.bench.cli import add_parser
from tokenmill.bench.client import resolve_endpoint
from tokenmill.bench.report import format_summary, format_sweep

from .fake_openai_server import FakeOpenAIServer, Script

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
VLLM_KEYS = [
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "generated_texts",
    "errors",
    "date",
    "backend",
    "endpoint_type",
    "label",
    "tokenizer_id",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "model_id",
    "num_prompts",
] + [  # vLLM's defaults: --percentile-metrics ttft,tpot,itl --metric-percentiles 99
    f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl") for stat in ("mean", "median", "std", "p99")
]


def _parse(argv: str | list[str]) -> argparse.Namespace:
    """Parse `tokenmill bench ARGV`; a string is split as a shell would."""
    parser = argparse.ArgumentParser(prog="tokenmill")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *(shlex.split(argv) if isinstance(argv, str) else argv)])


def _prompts_file(tmp_path: Path, count: int, **extra: object) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": f"r{i} hi", "output_length": 3, **extra}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_serve_sweep_writes_json_and_plots(
    fake_server, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    def script(payload: dict) -> Script:
        if payload["prompt"].startswith("r3 "):
            return Script(status=500, message="no capacity")
        return Script(ttft_s=0.02, itl_s=0.005, num_tokens=3)

    server = fake_server(script)
    args = _parse(
        ["serve", "--base-url", server.base_url, "--dataset-name", "file", "--dataset-path",
         str(_prompts_file(tmp_path, 6)), "--request-rate", "100,inf", "--goodput", "ttft:500", "tpot:50",
         "--output-json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots"), "--disable-tqdm",
         "--api-key", "sk-test"]
    )  # fmt: skip
    assert args.func(args) == 0

    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["request_rate"] for r in results] == [100.0, "inf"]
    for result in results:
        assert set(VLLM_KEYS) <= set(result)
        assert result["completed"] == 5 and result["failed"] == 1
        assert "HTTP 500: no capacity" in result["errors"]
        assert result["model_id"] == "fake-model"  # asked from /v1/models
        assert result["request_goodput"] == pytest.approx(5 / result["duration"])
        # The fake server waits 20 ms before its first token and 5 ms between tokens; on a loaded
        # machine only the lower bound is firm, and the first token comes before the last.
        assert 19.0 <= result["mean_ttft_ms"] < 1e3 * max(result["latencies"])
        assert "mean_e2el_ms" not in result and "p90_ttft_ms" not in result  # not asked for
        assert result["backend"] == result["endpoint_type"] == "openai"
    assert server.headers[0]["Authorization"] == "Bearer sk-test"
    assert all(p["max_tokens"] == 3 and p["model"] == "fake-model" for p in server.payloads)

    for name in ("latency_cdf.png", "throughput_vs_rate.png", "latency_vs_rate.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000

    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2
    assert "Request Rate Sweep" in out and "1 x HTTP 500: no capacity" in out


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_replays_a_trace_at_its_own_pace(fake_server, tmp_path: Path, processes: str) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.0, itl_s=0.0, num_tokens=1))
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(json.dumps({"timestamp": t, "prompt": "p", "output_length": 1}) + "\n" for t in (0, 200))
    )
    args = _parse(
        ["serve", "--base-url", server.base_url, "--model", "m", "--dataset-name", "file", "--dataset-path",
         str(path), "--trace-speedup", "2", "--output-json", str(tmp_path / "r.json"), "--disable-tqdm",
         "--num-client-processes", processes]
    )  # fmt: skip
    assert args.func(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["request_rate"] == "trace" and result["trace_speedup"] == 2.0
    assert result["duration"] == pytest.approx(0.1, abs=0.03)  # 200 ms of trace at 2x speed
    assert result["tpots"] == [None, None]  # one-token answers


@pytest.mark.parametrize("processes", ["1", "2"])
def test_serve_reports_where_the_long_gaps_were_and_its_own_gc_pauses(
    fake_server, tmp_path: Path, processes: str
) -> None:
    """A stream's 150 ms gap after its second token is listed (request, chunk, when, how long) and the
    20 ms ones are not; each client process reports its garbage-collection pauses."""
    server = fake_server(lambda payload: Script(ttft_s=0.0, itl_s=[0.02, 0.15, 0.02], num_tokens=4))
    args = _parse(
        ["serve", "--base-url", server.base_url, "--model", "m", "--dataset-name", "file", "--dataset-path",
         str(_prompts_file(tmp_path, 2)), "--output-json", str(tmp_path / "r.json"), "--disable-tqdm",
         "--num-client-processes", processes]
    )  # fmt: skip
    before = time.time()
    assert args.func(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    gaps = result["long_gaps"]
    assert sorted((request, chunk) for _, request, chunk, *_ in gaps) == [(0, 2), (1, 2)]
    for ended, _, _, ms, chars, replacements in gaps:
        assert 140 <= ms < 400 and before < ended < time.time()
        assert chars == len(" t2") and replacements == 0  # the chunk that ended the gap: the third
    pauses = result["client_gc"]
    assert [p["process"] for p in pauses] == (
        ["bench client"] if processes == "1" else ["bench client 0", "bench client 1"]
    )
    assert all(len(p["collections"]) == 3 and p["max_ms"] >= 0 for p in pauses)


def test_serve_with_no_successful_request_exits_nonzero(tmp_path: Path) -> None:
    args = _parse(
        ["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset-name", "file",
         "--dataset-path", str(_prompts_file(tmp_path, 2)), "--disable-tqdm"]
    )  # fmt: skip
    assert args.func(args) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--goodput", "ttft"], "--goodput"),
        (["--burstiness", "0.5", "--arrival-process", "constant"], "--burstiness"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--num-client-processes", "0"], "--num-client-processes"),
        (["--endpoint", "/v1/chat/completions", "--prompts-as-token-ids"], "--prompts-as-token-ids"),
        (["--metric-percentiles", "200"], "--metric-percentiles"),
    ],
)
def test_serve_rejects_bad_flags_before_sending(argv: list[str], message: str) -> None:
    args = _parse(["serve", "--model", "m", "--base-url", "http://127.0.0.1:9", *argv])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_vllm_flag_names_parse() -> None:
    args = _parse(
        "serve --dataset-name random --tokenizer t --num-prompts 7 --random-input-len 5 --random-output-len 6"
        " --random-range-ratio 0.2 --request-rate 1,inf --burstiness 0.5 --max-concurrency 3 --seed 4"
        " --goodput ttft:500 tpot:50 --ignore-eos"
    )
    assert (args.num_prompts, args.random_input_len, args.random_output_len) == (7, 5, 6)
    assert (args.request_rate, args.burstiness, args.max_concurrency, args.seed) == ("1,inf", 0.5, 3, 4)
    assert args.goodput == ["ttft:500", "tpot:50"] and args.ignore_eos
    throughput = _parse(["throughput", "--input-len", "9", "--output-len", "2", "--load-format", "dummy"])
    assert (throughput.random_input_len, throughput.random_output_len, throughput.model) == (9, 2, "default")
    latency = _parse(["latency", "--batch-size", "2", "--input-len", "3", "--output-len", "4"])
    assert (latency.batch_size, latency.input_len, latency.output_len) == (2, 3, 4)


def test_report_formats() -> None:
    summary = dict(completed=2, failed=0, duration=1.0, total_input_tokens=4, total_output_tokens=6)
    summary |= dict(
        request_throughput=2.0, request_goodput=1.0, output_throughput=6.0, total_token_throughput=10.0
    )
    summary |= dict(
        max_output_tokens_per_s=6.0, max_concurrent_requests=2, request_rate="inf", errors=["", ""]
    )
    summary |= dict(mean_ttft_ms=12.5, median_ttft_ms=12.5, p99_ttft_ms=13.0)
    text = format_summary(summary, percentiles=[99], metrics=["ttft"])
    assert "Request goodput (req/s):                      1.00" in text
    assert "P99 TTFT (ms):                               13.00" in text
    assert "Errors" not in text
    sweep = format_sweep([summary], percentile=99)
    assert sweep.splitlines()[2].split()[:3] == ["inf", "2.00", "1.00"]


def test_vllm_command_line_runs_chat_and_saves_results_as_vllm_names_them(
    fake_server, tiny_tokenizer_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`vllm bench serve`'s own flags: --backend openai-chat alone picks the chat endpoint, a random
    workload ignores EOS, sampling flags and headers are sent, and --save-result writes vLLM's file."""
    server = fake_server(lambda payload: Script(ttft_s=0.0, itl_s=0.0, num_tokens=3))
    monkeypatch.chdir(tmp_path)
    args = _parse(
        f"serve --backend openai-chat --base-url {server.base_url} --model org/tiny-model --tokenizer "
        f"{tiny_tokenizer_path} --dataset-name random --input-len 12 --output-len 3 --num-prompts 4 "
        "--request-rate 50 --max-concurrency 2 --temperature 0 --top-p 0.9 --header x-trace=abc "
        "--save-result --metadata tp=1 --disable-tqdm"
    )
    assert args.func(args) == 0
    assert len(server.payloads) == 4
    for payload in server.payloads:
        assert payload["messages"][0]["role"] == "user" and payload["max_completion_tokens"] == 3
        assert payload["ignore_eos"] is True  # vLLM's default for the random dataset
        assert (payload["temperature"], payload["top_p"]) == (0, 0.9) and "top_k" not in payload
    assert server.headers[0]["x-trace"] == "abc"
    [path] = list(tmp_path.glob("*.json"))
    assert re.fullmatch(r"openai-chat-50\.0qps-concurrency2-tiny-model-\d{8}-\d{6}\.json", path.name)
    result = json.loads(path.read_text())
    assert result["backend"] == "openai-chat" and result["endpoint"] == "/v1/chat/completions"
    assert result["completed"] == 4 and result["tp"] == "1" and result["request_rate"] == 50.0
    assert "ttfts" not in result and "errors" not in result  # per-request lists need --save-detailed


def test_save_detailed_append_and_result_file_names(fake_server, tmp_path: Path) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.0, itl_s=0.0, num_tokens=2))
    common = (
        f"serve --base-url {server.base_url} --model m --dataset-name file --dataset-path "
        f"{_prompts_file(tmp_path, 2)} --disable-tqdm --result-dir {tmp_path / 'out'} "
        "--result-filename r.json --save-result --no-ignore-eos"
    )
    for extra in ("--save-detailed --label mine", "--append-result"):
        args = _parse(f"{common} {extra}")
        assert args.func(args) == 0
    first, second = [json.loads(line) for line in (tmp_path / "out" / "r.json").read_text().splitlines()]
    assert first["label"] == "mine" and first["errors"] == ["", ""] and len(first["ttfts"]) == 2
    assert second["completed"] == 2 and "ttfts" not in second
    assert all("ignore_eos" not in p for p in server.payloads)
    sweep = _parse(f"{common} --request-rate 1,inf")
    with pytest.raises(ValueError, match="--result-filename"):
        sweep.func(sweep)


@pytest.mark.parametrize(
    ("backend", "endpoint", "expected"),
    [
        (None, None, ("/v1/completions", False, "openai")),
        ("openai-chat", None, ("/v1/chat/completions", True, "openai-chat")),
        ("vllm", None, ("/v1/completions", False, "vllm")),
        (None, "/v1/chat/completions", ("/v1/chat/completions", True, "openai-chat")),
        (None, "/openai/v1/completions", ("/openai/v1/completions", False, "openai")),
    ],
)
def test_backend_and_endpoint_resolve_as_vllm_pairs_them(backend, endpoint, expected) -> None:
    assert tuple(resolve_endpoint(backend, endpoint)) == expected


def test_backend_and_endpoint_of_different_apis_are_refused() -> None:
    with pytest.raises(ValueError, match="--backend openai-chat"):
        resolve_endpoint("openai-chat", "/v1/completions")
    with pytest.raises(ValueError, match="--backend openai "):
        resolve_endpoint("openai", "/v1/chat/completions")
    with pytest.raises(ValueError, match="--endpoint"):
        resolve_endpoint(None, "/v1/embeddings")


def test_without_model_or_tokenizer_the_listed_models_root_gives_the_tokenizer(
    tiny_tokenizer_path: Path, tmp_path: Path
) -> None:
    """vLLM loads the tokenizer from the first listed model's root (where the server loaded it from);
    a random workload then runs with neither --model nor --tokenizer (it had stopped: no tokenizer)."""
    with FakeOpenAIServer(
        lambda payload: Script(ttft_s=0.0, itl_s=0.0, num_tokens=2), root=str(tiny_tokenizer_path)
    ) as server:
        args = _parse(
            f"serve --base-url {server.base_url} --input-len 8 --output-len 2 --num-prompts 2 "
            f"--disable-tqdm --output-json {tmp_path / 'r.json'}"
        )
        assert args.func(args) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["model_id"] == "fake-model" and result["tokenizer_id"] == str(tiny_tokenizer_path)
    assert result["completed"] == 2
