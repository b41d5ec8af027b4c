"""`tokenmill serve` options, and the errors it gives before any model loads."""

from __future__ import annotations

import socket
import subprocess
import sys

from tokenmill.entrypoints.cli import build_parser, main


def test_serve_options():
    args = build_parser().parse_args(
        ["serve", "--port", "9000", "--served-model-name", "a", "b", "--api-key", "k", "--max-num-seqs", "4"]
    )
    assert (args.port, args.served_model_name, args.api_key, args.max_num_seqs) == (9000, ["a", "b"], "k", 4)
    assert build_parser().parse_args(["serve", "--disable-log-stats"]).disable_log_stats is True
    # Every interface by default, as `vllm serve` listens.
    assert (args.host, args.model, args.shutdown_timeout, args.access_log) == (
        "0.0.0.0",
        "default",
        30.0,
        True,
    )


def test_the_api_process_starts_the_core_before_it_imports_torch():
    """The API server's modules, the core's entry point among them, import neither torch nor transformers:
    the core process is started first and imports them (seconds) while the API process loads the
    tokenizer beside it, not after."""
    script = (
        "import sys, tokenmill.entrypoints.openai.api_server, tokenmill.serving.core_link;"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_taken_port_fails_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/no/such/model"]) == 2
    assert f"cannot listen on 0.0.0.0:{port}" in capsys.readouterr().err


def test_missing_model_is_a_clean_error(capsys):
    assert main(["serve", "--port", "0", "--model", "/no/such/model"]) == 2
    assert "model '/no/such/model' not found" in capsys.readouterr().err


def test_unsupported_architecture_is_one_clean_line(tmp_path):
    import json
    import subprocess
    import sys

    config = {"architectures": ["FooForCausalLM"], "model_type": "llama", "hidden_size": 64, "vocab_size": 9,
              "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", str(tmp_path),
               "--load-format", "dummy", "--skip-tokenizer-init", "--port", "0"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "FooForCausalLM" in output and "is not supported" in output
    assert "Traceback" not in output


def test_a_refusal_after_the_core_started_exits(tmp_path):
    """--reasoning-parser is checked against the tokenizer once the engine core runs: the refusal stops
    the core, and the server exits (it waited for the core's process forever)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--model", "default",
               "--port", "0", "--max-model-len", "256", "--num-kv-blocks", "32",
               "--reasoning-parser", "deepseek_r1"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "error: --reasoning-parser deepseek_r1: the model's tokenizer has no <think>" in output
    assert "Traceback" not in output


def test_an_engine_that_fails_to_start_is_one_line(monkeypatch, capsys):
    """A start-up failure that is not a bad configuration (out of device memory, a driver error) is one
    error line and exit code 1 (the core's log has the traceback); any other RuntimeError is a bug and
    keeps its traceback."""
    import argparse

    import pytest

    from tokenmill.entrypoints import cli
    from tokenmill.serving.core_link import EngineStartError

    def parser_raising(error):
        def build(command=None):
            parser = argparse.ArgumentParser()
            parser.set_defaults(func=lambda args: (_ for _ in ()).throw(error))
            return parser

        return build

    monkeypatch.setattr(cli, "build_parser", parser_raising(EngineStartError("CUDA out of memory")))
    assert cli.main([]) == 1
    assert "error: the engine failed to start: CUDA out of memory" in capsys.readouterr().err
    monkeypatch.setattr(cli, "build_parser", parser_raising(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main([])


def test_vllm_command_lines_fail_clearly_before_the_model_loads(capsys):
    """The model as `vllm serve MODEL` gives it; values vLLM takes that tokenmill cannot honour are one
    error line naming the option."""
    import pytest

    assert main(["serve", "/no/such/model", "--port", "0"]) == 2
    assert "model '/no/such/model' not found" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="two models given"):
        main(["serve", "/a", "--model", "/b", "--port", "0"])
    assert main(["serve", "--port", "0", "--no-enable-chunked-prefill"]) == 2
    assert "enable_chunked_prefill=False is not supported" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--chat-template", "/no/such/template.jinja"]) == 2
    assert "--chat-template '/no/such/template.jinja' looks like a file path" in capsys.readouterr().err
