"""Reading benchmark results and expressing them as fractions of the roofline."""

from __future__ import annotations

import pytest

from tokenmill.plan.calibrate import calibration_rows, parse_bench_result, read_bench_json
from tokenmill.plan.catalogue import MODELS
from tokenmill.plan.gpus import GPUS, ceilings_for
from tokenmill.plan.memory import Deployment
from tokenmill.plan.roofline import decode_point, prefill_point

RESULT = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "max_concurrency": 32,
    "random_input_len": 1024,
    "random_output_len": 256,
    "completed": 500,
    "duration": 60.0,
    "request_throughput": 8.0,
    "output_throughput": 2048.0,
    "total_token_throughput": 10240.0,
    "mean_ttft_ms": 80.0,
    "mean_tpot_ms": 14.0,
    "median_tpot_ms": 13.5,
    "mean_e2el_ms": 3650.0,
}


def test_concurrency_from_littles_law():
    result = parse_bench_result(RESULT)
    # 8 requests/s x 3.65 s in flight each
    assert result.concurrency == pytest.approx(29.2)
    assert (result.concurrency_source, result.batch) == ("Little's law", 29)
    assert (result.input_len, result.output_len, result.decode_context_len) == (1024, 256, 1152)


def test_concurrency_is_capped_by_max_concurrency_and_overridable():
    capped = parse_bench_result({**RESULT, "mean_e2el_ms": 8000.0})
    assert (capped.concurrency, capped.concurrency_source) == (32, "max_concurrency")
    no_rate = {k: v for k, v in RESULT.items() if k != "request_throughput"}
    assert parse_bench_result(no_rate).concurrency == 32
    assert parse_bench_result(RESULT, batch=5).concurrency_source == "--batch"


def test_e2e_latency_is_rebuilt_when_absent():
    result = parse_bench_result({k: v for k, v in RESULT.items() if k != "mean_e2el_ms"})
    assert result.concurrency == pytest.approx(8.0 * (80.0 + 14.0 * 255) / 1e3)


def test_lengths_fall_back_to_totals():
    data = {k: v for k, v in RESULT.items() if not k.startswith("random_")}
    data.update(total_input_tokens=500 * 1000, total_output_tokens=500 * 200)
    result = parse_bench_result(data)
    assert (result.input_len, result.output_len) == (1000, 200)


def test_rows_are_fractions_of_the_roofline():
    result = parse_bench_result(RESULT)
    deployment = Deployment(MODELS["llama-3.1-8b"], GPUS["H200"], context_len=1280)
    ceilings = ceilings_for(GPUS["H200"], "bf16", measured=False)
    decode = decode_point(deployment, ceilings, 1, result.batch, result.decode_context_len)
    prefill = prefill_point(deployment, ceilings, 1, result.input_len)
    rows = {row.metric: row for row in calibration_rows(result, decode, prefill)}
    assert rows["mean TPOT"].roofline == pytest.approx(decode.floor_s * 1e3)
    assert rows["mean TPOT"].fraction == pytest.approx(decode.floor_s * 1e3 / 14.0)
    assert rows["median TPOT"].fraction == pytest.approx(decode.floor_s * 1e3 / 13.5)
    assert rows["output throughput"].fraction == pytest.approx(2048.0 / (29 / decode.floor_s))
    assert rows["mean TTFT"].fraction == pytest.approx(prefill.floor_s * 1e3 / 80.0)
    assert all(0 < row.fraction < 1 for row in rows.values())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mean_tpot_ms": None}, "lacks mean_tpot_ms"),
        ({"mean_ttft_ms": "fast"}, "'mean_ttft_ms' must be a finite number"),
        ({"random_input_len": None}, "neither 'random_input_len' nor 'total_input_tokens'"),
        ({"request_throughput": None, "max_concurrency": None}, "pass --batch"),
    ],
)
def test_incomplete_results_are_clear_errors(change, message):
    with pytest.raises(ValueError, match=message):
        parse_bench_result({**RESULT, **change})


def test_unreadable_result_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read benchmark result .*missing.json"):
        read_bench_json(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_bench_json(broken)
    number = tmp_path / "number.json"
    number.write_text("42")
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_bench_json(number)


def test_a_rate_sweeps_file_says_to_pick_one_result(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text("[{}, {}]")
    with pytest.raises(ValueError, match="holds 2 results .a rate sweep's.: calibrate from one of them"):
        read_bench_json(path)
