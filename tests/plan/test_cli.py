"""`tokenmill plan` end to end: the JSON object, the table, calibration, charts and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.entrypoints.cli import main

REQUIRED_KEYS = {
    "weight_bytes",
    "kv_bytes_per_token",
    "kv_capacity_tokens",
    "max_concurrent_seqs",
    "min_tp",
    "decode_step_floor_s",
    "decode_bound",
    "decode_tok_s_ceiling",
    "prefill_floor_s",
}


def plan(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_for_llama_8b_on_h200(capsys):
    out = plan(capsys, "--model", "llama-3.1-8b", "--gpu", "H200")
    assert out.keys() >= REQUIRED_KEYS
    assert (out["weight_bytes"], out["kv_bytes_per_token"]) == (16_060_522_496, 131_072)
    assert (out["kv_capacity_tokens"], out["max_concurrent_seqs"], out["min_tp"]) == (895_232, 109, 1)
    assert out["decode_bound"] == "bandwidth"
    assert out["decode_tok_s_ceiling"] == pytest.approx(298.44, abs=0.01)
    assert out["decode_step_floor_s"] == pytest.approx(16_083_599_360 / 4.8e12)
    assert out["prefill_bound"] == "compute"
    assert [p["batch"] for p in out["decode_points"]] == [1, 109]
    assert out["compute_bound_batch"] is None and out["compute_bound_batch_weights_only"] == 207


def test_target_concurrency_is_the_tightest_of_kv_cache_running_batch_and_tpot(capsys):
    llama_h200 = ["--model", "llama-3.1-8b", "--gpu", "H200"]
    chat = [*llama_h200, "--input-len", "2048", "--output-len", "512"]
    out = plan(capsys, *llama_h200)  # 109 sequences of 8,192 tokens fill the KV cache
    assert (out["target_concurrency"], out["target_concurrency_bound"]) == (109, "kv_cache")
    out = plan(capsys, *chat)  # 349 sequences of 2,560 tokens fit, but the engine runs 256 at once
    assert (out["max_concurrent_seqs"], out["target_concurrency"]) == (349, 256)
    assert out["target_concurrency_bound"] == "max_num_seqs"
    assert plan(capsys, *chat, "--max-num-seqs", "128")["target_concurrency"] == 128
    # 20 ms at the measured 4.25 TB/s: B x (8,192 + 2,304 x 131,072) + STREAMED <= 85e9 bytes, B <= 231.8
    out = plan(capsys, *chat, "--tpot-ms", "20", "--measured")
    assert (out["target_concurrency"], out["target_concurrency_bound"]) == (231, "tpot")
    assert main(["plan", *chat, "--tpot-ms", "20", "--measured"]) == 0
    table = capsys.readouterr().out
    assert (
        "target concurrency per replica: 231 (the largest batch whose decode floor meets --tpot-ms)" in table
    )


def test_input_and_output_lengths_set_the_context_and_decode_length(capsys):
    out = plan(
        capsys,
        "--model",
        "qwen3-8b",
        "--gpu",
        "h100",
        "--input-len",
        "1000",
        "--output-len",
        "500",
        "--batch",
        "32",
    )
    assert (out["context_len"], out["decode_context_len"], out["input_len"], out["batch"]) == (
        1500,
        1250,
        1000,
        32,
    )
    assert out["decode_tok_s_aggregate"] == pytest.approx(32 * out["decode_tok_s_ceiling"])


def test_default_model_is_planned_from_its_gguf(capsys):
    out = plan(capsys, "--model", "default", "--gpu", "L40S")
    assert (out["model"], out["params"]) == ("SmolLM2-135M-Instruct.Q4_1", 134_515_008)
    assert out["weight_bytes"] == 2 * 134_515_008  # planned as served: dequantised to bf16
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23_040


def test_a_context_past_the_sliding_window_is_noted(tmp_path, capsys):
    config = {  # mistralai/Mistral-7B-v0.1
        "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
        "max_position_embeddings": 32768, "sliding_window": 4096,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = plan(capsys, "--model", str(tmp_path), "--gpu", "H200")
    assert (out["params"], out["kv_bytes_per_token"]) == (7_241_732_096, 131_072)
    assert out["notes"] == [
        "context 8,192 exceeds the model's 4,096-token sliding window, the most the engine serves it "
        "(its attention is full-context)"
    ]
    assert plan(capsys, "--model", str(tmp_path), "--gpu", "H200", "--context", "4096")["notes"] == []


def test_tp_and_replicas(capsys):
    out = plan(capsys, "--model", "llama-3.1-70b", "--gpu", "H200", "--num-gpus", "8")
    assert (out["tp"], out["min_tp"], out["data_parallel_replicas"]) == (2, 2, 4)
    out = plan(capsys, "--model", "llama-3.1-70b", "--gpu", "H200", "--tp", "4")
    assert (out["tp"], out["min_tp"], out["num_gpus"], out["weight_bytes_per_gpu"]) == (
        4,
        2,
        4,
        35_276_853_248,
    )


def test_measured_ceilings(capsys):
    out = plan(capsys, "--model", "llama-3.1-8b", "--gpu", "H200", "--measured")
    assert (out["ceilings"]["bandwidth_bytes_s"], out["ceilings"]["flops"]) == (4.25e12, 788e12)
    assert out["decode_step_floor_s"] == pytest.approx(16_083_599_360 / 4.25e12)


def test_custom_gpu(capsys):
    out = plan(
        capsys,
        "--model",
        "qwen3-0.6b",
        "--gpu",
        "custom",
        "--memory-gb",
        "32",
        "--bandwidth-tbs",
        "1.5",
        "--tflops",
        "200",
    )
    assert (out["gpu"], out["ops_per_byte"]) == ("custom", pytest.approx(200 / 1.5))


def test_table(capsys):
    assert (
        main(["plan", "--model", "mixtral-8x7b", "--gpu", "H200", "--weight-dtype", "fp8", "--batch", "16"])
        == 0
    )
    table = capsys.readouterr().out
    assert "mixtral-8x7b on 1 x H200 (tp 1 of 1 GPUs), fp8 weights, bf16 KV cache" in table
    assert "ceilings (datasheet): 4.80 TB/s, 1979 fp8 TFLOP/s; ops:byte 412" in table
    assert "smallest TP degree that fits" in table
    assert "TTFT floor" in table
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["batch", "bytes/step"])
    decode_rows = [line.split() for line in lines[header + 1 : header + 4]]
    # batch 1, the requested batch, and the 79 sequences of 8,192 tokens the KV cache holds
    assert [(row[0], row[7]) for row in decode_rows] == [
        ("1", "bandwidth"),
        ("16", "bandwidth"),
        ("79", "bandwidth"),
    ]


def test_chart(tmp_path, capsys):
    path = tmp_path / "roofline.png"
    out = plan(capsys, "--model", "llama-3.1-8b", "--gpu", "H200", "--batch", "64", "--chart", str(path))
    assert out["chart"] == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3.1-8b", "--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--model", "llama-3.1-8b"], "needs --model and --gpu"),
        (["--model", "llama-3.1-8b", "--gpu", "H200", "--batch", "0"], "--batch must be positive, got 0"),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--context", "-8"],
            "--context must be positive, got -8",
        ),
        (["--model", "llama-3.1-8b", "--gpu", "H200", "--num-gpus", "0"], "--num-gpus must be positive"),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--input-len", "-1", "--output-len", "5"],
            "--input-len must be positive",
        ),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--input-len", "100"],
            "--input-len and --output-len go together",
        ),
        (
            [
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "H200",
                "--input-len",
                "100",
                "--output-len",
                "50",
                "--context",
                "120",
            ],
            "--context 120 is shorter than",
        ),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--tflops", "100"],
            "--tflops applies to --gpu custom only",
        ),
        (["--model", "llama-3.1-8b", "--gpu", "L40S", "--measured"], "no measured ceilings for L40S"),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--tp", "4", "--num-gpus", "2"],
            "--tp 4 needs at least 4 GPUs",
        ),
        (["--model", "llama-3.1-70b", "--gpu", "H200"], "it fits at tp 2: pass --num-gpus 2"),
        (
            ["--model", "deepseek-v3", "--gpu", "rtx4090", "--num-gpus", "8"],
            "nor at any tensor-parallel degree",
        ),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--gpu-memory-utilization", "0"],
            "--gpu-memory-utilization must be in",
        ),
        (["--model", "no-such-model", "--gpu", "H200"], "unknown model 'no-such-model'"),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--max-num-seqs", "0"],
            "--max-num-seqs must be positive",
        ),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--tpot-ms", "3"],
            "--tpot-ms 3 is under the decode floor of one sequence (3.35 ms)",
        ),
        (["--model", "llama-3.1-8b", "--gpu", "H200", "--acceptance", "0.5"], "--acceptance goes with"),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--speculative", "4"],
            "--speculative needs --acceptance",
        ),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--speculative", "4", "--acceptance", "1.5"],
            "--acceptance is a probability in [0, 1]",
        ),
        (
            ["--model", "llama-3.1-8b", "--gpu", "H200", "--speculative", "0", "--acceptance", "0.5"],
            "--speculative must be positive",
        ),
    ],
)
def test_bad_input_is_a_clean_error(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_unwritable_chart_is_a_clean_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["plan", "--model", "qwen3-0.6b", "--gpu", "H200", "--chart", str(blocker / "x.png")]) == 2
    assert "cannot write the chart to" in capsys.readouterr().err


def test_unreadable_model_file_is_a_clean_error(tmp_path, capsys):
    broken = tmp_path / "model.gguf"
    broken.write_bytes(b"\0" * 64)
    assert main(["plan", "--model", str(broken), "--gpu", "H200"]) == 2
    assert "cannot read GGUF file" in capsys.readouterr().err


def test_calibrate(tmp_path, capsys):
    result = {
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "gpu": "H200",
        "random_input_len": 1024,
        "random_output_len": 256,
        "completed": 100,
        "max_concurrency": 16,
        "request_throughput": 4.0,
        "mean_e2el_ms": 4000.0,
        "mean_ttft_ms": 60.0,
        "mean_tpot_ms": 15.0,
        "median_tpot_ms": 15.0,
        "output_throughput": 1000.0,
    }
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result))
    assert main(["plan", "--calibrate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["plan"]["model"], out["plan"]["gpu"], out["plan"]["batch"]) == ("llama-3.1-8b", "H200", 16)
    rows = {row["metric"]: row for row in out["rows"]}
    assert rows["mean TPOT"]["fraction"] == pytest.approx(out["plan"]["decode_step_floor_s"] * 1e3 / 15.0)
    assert rows["mean TTFT"]["fraction"] == pytest.approx(out["plan"]["prefill_floor_s"] * 1e3 / 60.0)
    assert main(["plan", "--calibrate", str(path)]) == 0
    assert "fraction of roofline" in capsys.readouterr().out


def test_calibrate_needs_model_and_gpu_when_the_result_does_not_say(tmp_path, capsys):
    result = {
        "random_input_len": 512,
        "random_output_len": 128,
        "max_concurrency": 4,
        "mean_ttft_ms": 30.0,
        "mean_tpot_ms": 8.0,
        "output_throughput": 400.0,
    }
    path = tmp_path / "anonymous.json"
    path.write_text(json.dumps(result))
    assert main(["plan", "--calibrate", str(path)]) == 2
    assert "does not say which model it measured; pass --model" in capsys.readouterr().err
    assert main(["plan", "--calibrate", str(path), "--model", "qwen3-0.6b"]) == 2
    assert "does not say which gpu it measured; pass --gpu" in capsys.readouterr().err
    assert main(["plan", "--calibrate", str(path), "--model", "qwen3-0.6b", "--gpu", "H100"]) == 0
    path.write_text(json.dumps({**result, "model": "my-finetune"}))
    assert main(["plan", "--calibrate", str(path), "--gpu", "H100"]) == 2
    assert "names model 'my-finetune', which the planner cannot use" in capsys.readouterr().err


def test_planner_starts_without_torch_or_matplotlib():
    code = (
        "import argparse, sys\n"
        "from tokenmill.plan import cli\n"
        "parser = argparse.ArgumentParser(); cli.add_parser(parser.add_subparsers())\n"
        "args = parser.parse_args(['plan', '--model', 'qwen3-8b', '--gpu', 'H200', '--json'])\n"
        "args.func(args)\n"
        "print(sorted(m for m in ('torch', 'matplotlib', 'numpy', 'gguf') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_speculative_section_in_json_and_table(capsys):
    argv = ["--model", "llama-3.1-8b", "--gpu", "H200", "--input-len", "512", "--output-len", "256"]
    out = plan(capsys, *argv, "--batch", "64", "--speculative", "4", "--acceptance", "0.7")
    spec = out["speculative"]
    assert spec["tokens_per_step"] == pytest.approx((1 - 0.7**5) / 0.3)
    assert spec["verify"]["tokens"] == 64 * 5 and spec["verify_cost_source"] == "roofline"
    assert spec["speedup"] == pytest.approx(spec["tokens_per_step"] / spec["verify_cost"])
    assert plan(capsys, *argv)["speculative"] is None
    measured = plan(capsys, *argv, "--speculative", "4", "--acceptance", "0.7", "--verify-cost", "1.25")
    assert measured["speculative"]["speedup"] == pytest.approx((1 - 0.7**5) / 0.3 / 1.25)
    assert main(["plan", *argv, "--speculative", "4", "--acceptance", "0.7"]) == 0
    table = capsys.readouterr().out
    assert "tokens per verify step (tau)      2.77" in table and "predicted speed-up at batch 1" in table


@pytest.mark.parametrize(
    "command", [["plan", "--model", "llama-3.1-8b", "--gpu", "H200"], ["bench", "serve", "--help"]]
)
def test_the_tokenmill_command_plans_without_torch(command) -> None:
    """`tokenmill plan` and `tokenmill bench serve` import neither torch nor the engine (docs/plan.md,
    docs/bench.md): the command builds only the chosen subcommand's parser."""
    import subprocess
    import sys

    code = (
        "import sys\nfrom tokenmill.entrypoints.cli import main\n"
        f"try:\n    main({command!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


MODELOPT = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}
MODELOPT_BESIDE = ("hf_quant_config.json", MODELOPT)
AUTOAWQ_BESIDE = ("quant_config.json", {"w_bit": 4, "q_group_size": 128, "zero_point": True})


def ct_weights(**weights) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": weights}}}


@pytest.mark.parametrize(
    ("quantization", "beside", "want"),
    [
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, None, "fp8"),
        (None, MODELOPT_BESIDE, "fp8"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, None, "fp8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, None, "int4"),
        (None, AUTOAWQ_BESIDE, "int4"),
        (ct_weights(num_bits=4), None, "int4"),
        (ct_weights(num_bits=8, type="float"), None, "fp8"),
        (None, None, "bf16"),
    ],
)
def test_a_quantized_checkpoint_plans_in_its_own_weight_dtype(capsys, tmp_path, quantization, beside, want):
    """Without --weight-dtype the planner takes the checkpoint's (it had planned bf16 weights for every
    checkpoint); --weight-dtype still overrides it."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072}  # fmt: skip
    if quantization is not None:
        config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    if beside is not None:
        (tmp_path / beside[0]).write_text(json.dumps(beside[1]))
    assert plan(capsys, "--model", str(tmp_path), "--gpu", "H200")["weight_dtype"] == want
    assert plan(capsys, "--model", str(tmp_path / "config.json"), "--gpu", "H200")["weight_dtype"] == want
    overridden = plan(capsys, "--model", str(tmp_path), "--gpu", "H200", "--weight-dtype", "bf16")
    assert overridden["weight_dtype"] == "bf16"
