"""The n-gram proposer and the speculative_config knob."""

from __future__ import annotations

import argparse

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
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "larger than"),
        ("ngram", "must be a JSON object"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value)


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
