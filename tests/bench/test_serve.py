"""run_load + summarize against the scripted fake server: measured latencies equal the script's."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tokenmill.bench.load import LoadRun, ServeTarget, run_load, run_load_processes
from tokenmill.bench.metrics import summarize
from tokenmill.bench.prompts import SampleRequest

from .fake_openai_server import FakeOpenAIServer, Script

# Scheduling noise of a 2-core machine; measured on an idle one the error is 1-3 ms, and once 10.1 ms at
# P90 late in a full suite run on a slower (AVX2) VM.
TOLERANCE_MS = 15.0


def _samples(count: int, output_len: int = 8) -> list[SampleRequest]:
    return [
        SampleRequest(prompt=f"r{i} hello there", prompt_len=3, expected_output_len=output_len)
        for i in range(count)
    ]


def _index(payload: dict) -> int:
    prompt = payload.get("prompt") or payload["messages"][-1]["content"]
    return int(prompt.split()[0][1:])


def _run(
    server: FakeOpenAIServer,
    samples: list[SampleRequest],
    offsets: list[float] | None = None,
    *,
    endpoint: str = "/v1/completions",
    **kwargs: object,
) -> LoadRun:
    target = ServeTarget(
        api_url=server.base_url + endpoint, model="fake-model", chat=endpoint.endswith("chat/completions")
    )
    offsets = offsets if offsets is not None else [0.0] * len(samples)
    return asyncio.run(run_load(target, samples, offsets, **kwargs))


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_latencies_match_the_script(fake_server, endpoint: str) -> None:
    # 100 ms to the first token, then 5 more tokens 20 ms apart: E2EL 200 ms, TPOT 20 ms.
    server = fake_server(lambda payload: Script(ttft_s=0.1, itl_s=0.02, num_tokens=6))
    run = _run(server, _samples(6), endpoint=endpoint, num_warmups=6)
    summary = summarize(run.results, run.duration_s, percentiles=[50, 90, 99])

    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 36  # from the usage chunks
    assert summary["total_input_tokens"] == 18
    for key, expected in [("ttft", 100.0), ("tpot", 20.0), ("itl", 20.0), ("e2el", 200.0)]:
        for stat in ("mean", "median", "p50", "p90", "p99"):
            assert summary[f"{stat}_{key}_ms"] == pytest.approx(expected, abs=TOLERANCE_MS), (stat, key)
    assert all(len(r.itl) == 5 for r in run.results)
    assert summary["duration"] == pytest.approx(0.2, abs=0.03)
    assert summary["max_concurrent_requests"] == 6
    assert summary["output_throughput"] == pytest.approx(36 / summary["duration"])


def test_percentiles_and_goodput_over_scripted_spread(fake_server) -> None:
    # Request i: TTFT 40 + 20*i ms, then 3 tokens 10 ms apart.
    server = fake_server(
        lambda payload: Script(ttft_s=0.04 + 0.02 * _index(payload), itl_s=0.01, num_tokens=4)
    )
    run = _run(server, _samples(10), num_warmups=10)
    slos = {"ttft": 150.0, "tpot": 30.0}
    summary = summarize(run.results, run.duration_s, percentiles=[90, 99], goodput_slos_ms=slos)

    scripted_ttfts = 40.0 + 20.0 * np.arange(10)
    assert summary["mean_ttft_ms"] == pytest.approx(130.0, abs=TOLERANCE_MS)
    assert summary["median_ttft_ms"] == pytest.approx(np.median(scripted_ttfts), abs=TOLERANCE_MS)
    assert summary["p90_ttft_ms"] == pytest.approx(np.percentile(scripted_ttfts, 90), abs=TOLERANCE_MS)
    assert summary["p99_ttft_ms"] == pytest.approx(np.percentile(scripted_ttfts, 99), abs=TOLERANCE_MS)
    assert summary["std_ttft_ms"] == pytest.approx(np.std(scripted_ttfts), abs=TOLERANCE_MS)
    assert summary["p99_e2el_ms"] == pytest.approx(np.percentile(scripted_ttfts + 30.0, 99), abs=TOLERANCE_MS)
    # TTFT 40..140 ms meet the 150 ms objective: six requests.
    assert summary["request_goodput"] * summary["duration"] == pytest.approx(6.0)


def test_failures_are_counted_with_their_messages(fake_server) -> None:
    def script(payload: dict) -> Script:
        index = _index(payload)
        if index in (1, 4):
            return Script(status=500, message="engine exploded")
        if index == 2:
            return Script(status=400, message="prompt too long")
        if index == 3:
            return Script(num_tokens=5, error_after=2, message="worker died mid-stream")
        return Script(ttft_s=0.02, itl_s=0.01, num_tokens=3)

    server = fake_server(script)
    run = _run(server, _samples(6), num_warmups=6)
    summary = summarize(run.results, run.duration_s, goodput_slos_ms={"e2el": 1000.0})

    assert summary["completed"] == 2 and summary["failed"] == 4
    assert summary["errors"] == [
        "",
        "HTTP 500: engine exploded",
        "HTTP 400: prompt too long",
        "stream error: worker died mid-stream",
        "HTTP 500: engine exploded",
        "",
    ]
    assert summary["total_output_tokens"] == 6
    assert summary["request_goodput"] * summary["duration"] == pytest.approx(2.0)
    assert summary["mean_ttft_ms"] == pytest.approx(20.0, abs=TOLERANCE_MS)


def test_unreachable_server_fails_every_request_without_raising() -> None:
    target = ServeTarget(api_url="http://127.0.0.1:9/v1/completions", model="m")
    run = asyncio.run(run_load(target, _samples(3), [0.0, 0.0, 0.0]))
    summary = summarize(run.results, run.duration_s)
    assert summary["completed"] == 0 and summary["failed"] == 3
    assert all(error.startswith("ClientConnectorError") for error in summary["errors"])
    assert summary["mean_ttft_ms"] == 0.0 and summary["request_throughput"] == 0.0


def test_max_concurrency_serializes_requests(fake_server) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.03, itl_s=0.01, num_tokens=3))  # 50 ms each
    run = _run(server, _samples(4), max_concurrency=1, num_warmups=1)
    summary = summarize(run.results, run.duration_s)
    assert summary["max_concurrent_requests"] == 1
    assert run.duration_s == pytest.approx(0.2, abs=0.03)
    starts = sorted(r.start_time for r in run.results)
    assert np.diff(starts) == pytest.approx([0.05] * 3, abs=TOLERANCE_MS / 1e3)


def test_requests_leave_on_their_arrival_schedule(fake_server) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.01, itl_s=0.01, num_tokens=2))
    offsets = [0.0, 0.03, 0.05, 0.12]
    run = _run(server, _samples(4), offsets, num_warmups=4)
    first = run.results[0].start_time
    sent = [r.start_time - first for r in run.results]
    assert sent == pytest.approx(offsets, abs=TOLERANCE_MS / 1e3)
    assert run.duration_s == pytest.approx(0.14, abs=0.02)


def test_warmup_requests_are_sent_but_not_counted(fake_server) -> None:
    server = fake_server(lambda payload: Script(ttft_s=0.01, itl_s=0.01, num_tokens=2))
    run = _run(server, _samples(3), num_warmups=2)
    assert len(server.payloads) == 5
    assert len(run.results) == 3 and run.warmup_errors == []
    assert summarize(run.results, run.duration_s)["completed"] == 3


def test_client_processes_split_the_load_and_keep_one_clock(fake_server) -> None:
    # Request i answers after 20, 40 or 60 ms (i % 3), so a result returned in the wrong place shows.
    server = fake_server(
        lambda payload: Script(ttft_s=0.02 * (1 + _index(payload) % 3), itl_s=0.01, num_tokens=4)
    )
    target = ServeTarget(api_url=server.base_url + "/v1/completions", model="fake-model")
    samples = _samples(9)
    offsets = [0.02 * i for i in range(9)]
    run = run_load_processes(target, samples, offsets, processes=3, max_concurrency=6, num_warmups=4)

    assert len(server.payloads) == 9 + 4
    # Each result's TTFT is its own request's: never early, and nearest its own of the three (a process
    # scheduled late on a busy 2-core machine can add 10 ms; a misplaced result is 20 ms off or more).
    candidates = (0.02, 0.04, 0.06)
    for i, result in enumerate(run.results):
        expected = candidates[i % 3]
        assert result.ttft >= expected - 0.002
        assert min(candidates, key=lambda c: abs(c - result.ttft)) == expected, (i, result.ttft)
    # Send times from three processes line up on the schedule: one clock, one start.
    sent = [r.start_time - run.start_time for r in run.results]
    assert sent == pytest.approx(offsets, abs=2 * TOLERANCE_MS / 1e3)
    summary = summarize(run.results, run.duration_s)
    assert summary["completed"] == 9 and summary["total_output_tokens"] == 36
    assert run.duration_s == pytest.approx(0.16 + 0.03 + 0.03, abs=0.05)


def test_client_processes_check_their_count_and_count_failed_requests(fake_server) -> None:
    target = ServeTarget(api_url="not a url", model="fake-model")
    with pytest.raises(ValueError, match="--num-client-processes"):
        run_load_processes(target, _samples(2), [0.0, 0.0], processes=0)
    # Bad URLs are request failures (counted), not process failures.
    run = run_load_processes(target, _samples(4), [0.0] * 4, processes=2)
    assert [r.success for r in run.results] == [False] * 4 and all(r.error for r in run.results)


def test_a_connection_dropped_mid_stream_is_a_failure_and_the_run_goes_on(fake_server) -> None:
    def script(payload: dict) -> Script:
        if _index(payload) == 1:
            return Script(ttft_s=0.02, itl_s=0.01, num_tokens=6, drop_after=3)
        return Script(ttft_s=0.02, itl_s=0.01, num_tokens=3)

    server = fake_server(script)
    run = _run(server, _samples(3))
    summary = summarize(run.results, run.duration_s)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"][1].startswith("ClientPayloadError")
    assert summary["output_lens"] == [3, 0, 3] and summary["total_output_tokens"] == 6
    assert summary["mean_ttft_ms"] == pytest.approx(20.0, abs=TOLERANCE_MS)  # the broken one left out
    assert run.duration_s < 1.0


def test_a_chunk_of_several_tokens_is_one_gap_and_tpot_counts_every_token(fake_server) -> None:
    """Speculative decoding or a server that batches deltas sends several tokens a chunk: vLLM's ITL
    has one gap per chunk, and TPOT spreads the decode time over all tokens after the first."""
    server = fake_server(lambda payload: Script(ttft_s=0.05, itl_s=0.04, num_tokens=3, usage_tokens=9))
    run = _run(server, _samples(2), num_warmups=2)
    summary = summarize(run.results, run.duration_s)
    assert summary["output_lens"] == [9, 9] and [len(gaps) for gaps in summary["itls"]] == [2, 2]
    assert summary["mean_itl_ms"] == pytest.approx(40.0, abs=TOLERANCE_MS)
    assert summary["mean_tpot_ms"] == pytest.approx(80.0 / 8, abs=TOLERANCE_MS / 4)
    assert summary["mean_e2el_ms"] == pytest.approx(130.0, abs=TOLERANCE_MS)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_e2el_ends_at_the_last_choice_chunk_not_at_the_usage_chunk(fake_server, endpoint: str) -> None:
    """vLLM's E2EL (and so TPOT) ends at the last chunk that carries a choice: a usage chunk or [DONE]
    the server sends late is not part of the answer (it had been: E2EL ran to [DONE])."""
    server = fake_server(lambda payload: Script(ttft_s=0.05, itl_s=0.02, num_tokens=3, usage_delay_s=0.15))
    run = _run(server, _samples(2), endpoint=endpoint, num_warmups=2)
    summary = summarize(run.results, run.duration_s)
    assert summary["total_output_tokens"] == 6  # the late usage chunk still counts the tokens
    assert summary["mean_e2el_ms"] == pytest.approx(90.0, abs=TOLERANCE_MS)
    assert summary["mean_tpot_ms"] == pytest.approx(20.0, abs=TOLERANCE_MS / 2)
