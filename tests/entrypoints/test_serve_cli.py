"""`tokenmill serve` options, and the errors it gives before any model loads."""

from __future__ import annotations

import socket

from tokenmill.entrypoints.cli import build_parser, main


def test_serve_options():
    args = build_parser().parse_args(
        ["serve", "--port", "9000", "--served-model-name", "a", "b", "--api-key", "k", "--max-num-seqs", "4"]
    )
    assert (args.port, args.served_model_name, args.api_key, args.max_num_seqs) == (9000, ["a", "b"], "k", 4)
    assert (args.host, args.model, args.shutdown_timeout, args.access_log) == (
        "127.0.0.1",
        "default",
        30.0,
        True,
    )


def test_taken_port_fails_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/no/such/model"]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_missing_model_is_a_clean_error(capsys):
    assert main(["serve", "--port", "0", "--model", "/no/such/model"]) == 2
    assert "model '/no/such/model' not found" in capsys.readouterr().err
