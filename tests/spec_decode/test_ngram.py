"""The n-gram proposer and the speculative_config knob."""

from __future__ import annotations

import argparse
import json

import pytest

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.spec_decode import NgramProposer, SpeculativeConfig


def test_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]  # "1 2" seen at the start
    assert proposer.propose([7, 1, 2, 9, 5, 1, 2, 8, 1, 2]) == [8, 1, 2]  # the latest of two matches
    # The longest suffix wins: "4 1 2" matched at 2 beats the later "1 2" at 6.
    assert proposer.propose([0, 4, 1, 2, 5, 6, 1, 2, 3, 4, 1, 2]) == [5, 6, 1]
    assert proposer.propose([5, 6, 7]) == []
    assert proposer.propose([4]) == []
    assert proposer.propose([9, 9, 9, 9]) == [9]  # only one token follows the match
    assert proposer.propose([1, 2, 3, 4, 1, 2], max_tokens=1) == [3]
    assert proposer.propose([1, 2, 3, 4, 1, 2], max_tokens=0) == []
    assert NgramProposer(3, 2, 3).propose([1, 2, 3, 4, 5, 2]) == []  # a 1-token match is too short


def test_config_is_checked_and_named() -> None:
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == SpeculativeConfig("ngram", 3)
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 3}, "needs model, the EAGLE head's directory"),
        ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "model applies to methods"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "draft_layers": 2},
            "applies to method 'layer_skip'",
        ),
        ({"method": "layer_skip", "num_speculative_tokens": 3, "draft_layers": 0}, "needs draft_layers"),
        ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, r"unknown key\(s\) \['k'\]"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3},
            "larger than",
        ),
        ("ngram", "must be a JSON object"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value)


def test_vllm_forms_are_taken_as_vllm_reads_them(tmp_path) -> None:
    """vLLM's ngram defaults (one bound left out takes the other's value, both left out 5), its method
    inferred from the model, draft_tensor_parallel_size and the draft's max_model_len."""

    def parse(**keys) -> SpeculativeConfig:
        return EngineConfig(speculative_config={"num_speculative_tokens": 3, **keys}).speculative_config

    def bounds(config: SpeculativeConfig) -> tuple[int, int]:
        return config.prompt_lookup_min, config.prompt_lookup_max

    assert bounds(parse(method="ngram")) == (5, 5)
    assert bounds(parse(method="ngram", prompt_lookup_max=3)) == (3, 3)
    assert bounds(parse(method="ngram", prompt_lookup_min=6)) == (6, 6)
    assert bounds(parse(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4)) == (2, 4)
    assert parse(model="ngram") == parse(method="[ngram]") == parse(method="ngram", model="[ngram]")
    assert parse(model="ngram") == SpeculativeConfig("ngram", 3)

    # The method from the model: its name, else its config.json's architectures, else a draft model.
    for name, architectures, method in (
        ("EAGLE-LLaMA3-Instruct-8B", ["LlamaForCausalLM"], "eagle"),
        ("EAGLE3-LLaMA3.1-Instruct-8B", ["LlamaForCausalLM"], "eagle3"),
        ("head-a", ["LlamaForCausalLMEagle3"], "eagle3"),
        ("head-b", ["EagleLlamaForCausalLM"], "eagle"),
        ("draft", ["LlamaForCausalLM"], "draft_model"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"architectures": architectures}))
        config = parse(model=str(tmp_path / name))
        assert (config.method, config.model) == (method, str(tmp_path / name)), name
    assert parse(model="default").method == "draft_model"

    assert parse(method="ngram", draft_tensor_parallel_size=1).draft_tensor_parallel_size == 1
    tp2 = EngineConfig(
        tensor_parallel_size=2,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2},
    )
    assert tp2.speculative_config.draft_tensor_parallel_size == 2
    assert parse(method="ngram", max_model_len=64).max_model_len == 64
    bad = [
        ({}, "needs 'method', or a 'model'"),
        ({"method": "ngram", "draft_tensor_parallel_size": 0}, "draft_tensor_parallel_size must be"),
        ({"method": "ngram", "max_model_len": 0}, "max_model_len must be a positive"),
        ({"method": "ngram", "disable_by_batch_size": True}, "disable_by_batch_size must be"),
        ({"method": "ngram", "min_acceptance": True}, "min_acceptance must be"),
        ({"method": "ngram", "tensor_parallel_size": 1}, r"unknown key\(s\) \['tensor_parallel_size'\]"),
    ]
    for keys, message in bad:
        with pytest.raises(ValueError, match=message):
            parse(**keys)
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 1 is not supported"):
        EngineConfig(
            tensor_parallel_size=2,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 3,
                "draft_tensor_parallel_size": 1,
            },
        )


def test_command_line_takes_json() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    assert engine_config_from_args(args).speculative_config == SpeculativeConfig("ngram", 5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "ngram"])


def naive_propose(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, spelled out: the longest suffix first, its latest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_the_definition_on_random_texts_and_keeps_a_request_array() -> None:
    import random

    rng = random.Random(0)
    for trial in range(400):
        k, min_n = rng.randint(1, 5), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(1, 60))]  # small vocabulary: many matches
        proposer = NgramProposer(k, min_n, max_n)
        assert proposer.propose(tokens) == naive_propose(tokens, k, min_n, max_n), (trial, tokens)
    proposer = NgramProposer(3, 1, 3)
    text = [rng.randint(0, 6) for _ in range(20)]
    for _ in range(1, 40):  # the text grows a token at a time, as a request's does
        text.append(rng.randint(0, 6))
        assert proposer.propose(text, request_id="r") == naive_propose(text, 3, 1, 3)
    proposer.forget("r")
    assert proposer.propose([1, 2, 1], request_id="r") == [2, 1]  # a fresh array after forget
