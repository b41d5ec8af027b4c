"""Engine options on the command line mirror EngineConfig field for field and build it back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.engine_args import (
    add_engine_args,
    engine_config_from_args,
    parse_bytes,
    parse_token_count,
)


def parse(*argv: str, exclude: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, exclude=exclude)
    return parser.parse_args(list(argv))


def test_every_field_has_an_option_and_defaults_round_trip():
    args = parse()
    assert {f.name for f in dataclasses.fields(EngineConfig)} <= set(vars(args))
    assert engine_config_from_args(args) == EngineConfig()


def test_options_build_the_config():
    config = engine_config_from_args(
        parse(
            "--model",
            "m.gguf",
            "--max-model-len",
            "512",
            "--max-num-seqs",
            "8",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--kv-cache-memory",
            "1.5GiB",
            "--gpu-memory-utilization",
            "0.5",
            "--dtype",
            "bf16",
            "--max-waiting-requests",
            "4",
            "--enforce-eager",
        )  # fmt: skip
    )
    assert config.model == "m.gguf" and config.max_model_len == 512 and config.max_num_seqs == 8
    assert config.block_size == 32 and config.enable_prefix_caching is False
    assert config.kv_cache_memory == 3 << 29 and config.gpu_memory_utilization == 0.5
    assert config.dtype == "bfloat16" and config.max_waiting_requests == 4 and config.enforce_eager is True


def test_excluded_fields_keep_defaults_and_overrides_win():
    args = parse(exclude=("model", "seed"))
    assert not hasattr(args, "model")
    assert engine_config_from_args(args, seed=5).seed == 5


def test_bad_values():
    with pytest.raises(SystemExit):
        parse("--max-num-seqs", "many")
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        engine_config_from_args(parse("--max-num-seqs", "0"))


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4GiB", 4 << 30),
        ("512MiB", 512 << 20),
        ("2G", 2 << 30),
        ("1024", 1024),
        ("1.5k", 1536),
        ("1e3", 1000),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


def test_parse_bytes_rejects_garbage():
    with pytest.raises(argparse.ArgumentTypeError, match="4GiB"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    "text, expected", [("4096", 4096), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1M", 1 << 20)]
)
def test_token_counts_take_vllms_suffixes(text, expected):
    assert parse_token_count(text) == expected
    config = engine_config_from_args(parse("--max-model-len", text, "--max-num-batched-tokens", text))
    assert config.max_model_len == config.max_num_batched_tokens == expected


def test_token_counts_refuse_what_vllm_refuses():
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 1.5k"):
        parse_token_count("1.5K")
    with pytest.raises(argparse.ArgumentTypeError, match="32k"):
        parse_token_count("lots")


def test_vllms_dtype_names():
    assert EngineConfig(dtype="float").dtype == "float32" and EngineConfig(dtype="half").dtype == "float16"


def test_vllm_knobs_that_hold_here_are_accepted():
    config = engine_config_from_args(parse("--trust-remote-code", "--enable-chunked-prefill"))
    assert config.trust_remote_code is True and config.enable_chunked_prefill is True
    with pytest.raises(ValueError, match="enable_chunked_prefill=False is not supported"):
        EngineConfig(enable_chunked_prefill=False)
