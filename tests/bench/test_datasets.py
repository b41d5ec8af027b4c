"""Workloads: exact prompt lengths after re-encoding, shared prefixes, ShareGPT shape, JSONL and traces."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.datasets import (
    SHAREGPT_MAX_INPUT_LEN,
    conversation_requests,
    prefix_repetition_requests,
    random_requests,
    samples_from_args,
    sharegpt_like_requests,
    sharegpt_requests,
)
from tokenmill.bench.prompts import PromptMaker
from tokenmill.bench.traces import TRACE_BLOCK_TOKENS, file_requests


def test_random_text_prompts_reencode_to_their_stated_length(tiny_tokenizer) -> None:
    requests = random_requests(
        tiny_tokenizer, num_prompts=40, input_len=60, output_len=20, range_ratio=0.5, prefix_len=7, seed=1
    )
    input_lens = [r.prompt_len for r in requests]
    assert all(len(tiny_tokenizer.encode(r.prompt)) == r.prompt_len for r in requests)
    assert min(input_lens) >= 7 + 30 and max(input_lens) <= 7 + 90
    assert len(set(input_lens)) > 10  # spread over the range, not one length
    assert all(10 <= r.expected_output_len <= 30 for r in requests)
    assert requests == random_requests(
        tiny_tokenizer, num_prompts=40, input_len=60, output_len=20, range_ratio=0.5, prefix_len=7, seed=1
    )


def test_random_token_id_prompts_share_the_prefix(tiny_tokenizer) -> None:
    requests = random_requests(
        tiny_tokenizer, num_prompts=5, input_len=16, output_len=4, prefix_len=8, as_token_ids=True
    )
    assert all(len(r.prompt) == r.prompt_len == 24 for r in requests)
    assert len({tuple(r.prompt[:8]) for r in requests}) == 1
    assert all(not set(r.prompt) & tiny_tokenizer.special_token_ids for r in requests)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        random_requests(tiny_tokenizer, num_prompts=1, input_len=4, output_len=4, range_ratio=1.0)


def test_prefix_repetition_uses_each_prefix_equally(tiny_tokenizer) -> None:
    requests = prefix_repetition_requests(
        tiny_tokenizer,
        num_prompts=12,
        prefix_len=10,
        suffix_len=5,
        num_prefixes=3,
        output_len=7,
        as_token_ids=True,
    )
    prefixes = [tuple(r.prompt[:10]) for r in requests]
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]
    assert len({tuple(r.prompt[10:]) for r in requests}) == 12
    assert all(r.prompt_len == 15 and r.expected_output_len == 7 for r in requests)
    texts = prefix_repetition_requests(
        tiny_tokenizer, num_prompts=4, prefix_len=10, suffix_len=5, num_prefixes=2, output_len=7
    )
    assert all(len(tiny_tokenizer.encode(r.prompt)) == r.prompt_len for r in texts)


def test_conversations_grow_turn_by_turn_over_shared_system_prompts(tiny_tokenizer) -> None:
    requests = conversation_requests(
        tiny_tokenizer, num_prompts=10, num_conversations=4, system_prompt_len=12, num_system_prompts=2,
        turn_len=3, output_len=5, as_token_ids=True,
    )  # fmt: skip
    assert len(requests) == 10
    # Turn by turn: all four conversations' first turns, then their second, then two third turns.
    assert [r.prompt_len for r in requests] == [15] * 4 + [23] * 4 + [31] * 2
    turns = [tuple(r.prompt) for r in requests]
    for later in turns[4:]:
        earlier = [t for t in turns if len(t) == len(later) - 8 and later[: len(t)] == t]
        assert len(earlier) == 1  # each turn extends exactly one earlier turn (plus its answer)
    systems = {t[:12] for t in turns[:4]}
    assert len(systems) == 2 and len({t[12:] for t in turns[:4]}) == 4
    # The second round continues every conversation once.
    assert sorted(next(i for i, t in enumerate(turns[:4]) if later[:15] == t) for later in turns[4:8]) == [
        0,
        1,
        2,
        3,
    ]
    assert all(r.expected_output_len == 5 for r in requests)
    with pytest.raises(ValueError, match="--conversation-num"):
        conversation_requests(
            tiny_tokenizer, num_prompts=1, num_conversations=0, system_prompt_len=1, num_system_prompts=1,
            turn_len=1, output_len=1,
        )  # fmt: skip


def test_conversations_as_chat_turns(tiny_tokenizer) -> None:
    requests = conversation_requests(
        tiny_tokenizer, num_prompts=6, num_conversations=3, system_prompt_len=12, num_system_prompts=2,
        turn_len=4, output_len=5, as_messages=True,
    )  # fmt: skip
    roles = [[m["role"] for m in r.messages] for r in requests]
    assert roles == [["system", "user"]] * 3 + [["system", "user", "assistant", "user"]] * 3
    for r in requests:
        lengths = [len(tiny_tokenizer.encode(m["content"])) for m in r.messages]
        assert lengths == [12, 4, 5, 4][: len(lengths)]  # each turn's text alone has its length
        assert r.prompt_len == sum(lengths) and r.prompt == "\n".join(m["content"] for m in r.messages)
    # A second turn repeats its conversation's first turn exactly; two system prompts are shared by three.
    firsts = {r.messages[1]["content"]: r.messages for r in requests[:3]}
    assert all(firsts[r.messages[1]["content"]] == r.messages[:2] for r in requests[3:])
    assert len({r.messages[0]["content"] for r in requests}) == 2


def test_sharegpt_like_lengths_follow_the_published_shape(tiny_tokenizer) -> None:
    requests = sharegpt_like_requests(tiny_tokenizer, num_prompts=400, seed=0)
    inputs = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.expected_output_len for r in requests])
    # Means near ShareGPT's 161 in / 338 out; long right tails (mean well above the median).
    assert 130 < inputs.mean() < 190 and 280 < outputs.mean() < 380
    assert inputs.mean() > 1.2 * np.median(inputs) and outputs.mean() > 1.1 * np.median(outputs)
    assert inputs.min() >= 4 and inputs.max() <= SHAREGPT_MAX_INPUT_LEN
    assert all(r.prompt.startswith("User:") for r in requests)
    assert all(len(tiny_tokenizer.encode(r.prompt)) == r.prompt_len for r in requests[:50])
    fixed = sharegpt_like_requests(tiny_tokenizer, num_prompts=3, output_len=32)
    assert [r.expected_output_len for r in fixed] == [32, 32, 32]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_prompts(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "the boy read", "output_length": 5},
            {"prompt": [9, 8, 7]},
            {"prompt": "hand", "max_tokens": 2},
        ],
    )
    requests = file_requests(path, tiny_tokenizer, default_output_len=11)
    assert [r.expected_output_len for r in requests] == [5, 11, 2]
    assert requests[0].prompt_len == len(tiny_tokenizer.encode("the boy read"))
    assert requests[1].prompt == [9, 8, 7] and requests[1].prompt_len == 3
    assert [r.prompt for r in file_requests(path, None, num_prompts=2)] == ["the boy read", [9, 8, 7]]
    assert file_requests(path, None)[0].prompt_len == 0  # counted from the server's usage instead


def test_trace_with_timestamps_and_shared_hash_blocks(tmp_path: Path, tiny_tokenizer) -> None:
    path = _write_jsonl(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 500, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 0, "input_length": 520, "output_length": 4, "hash_ids": [1, 3]},
        ],
    )
    requests = file_requests(path, tiny_tokenizer, as_token_ids=True)
    assert [r.timestamp_ms for r in requests] == [0.0, 500.0]  # sorted by time
    assert [r.prompt_len for r in requests] == [520, 600]
    block = TRACE_BLOCK_TOKENS
    assert requests[0].prompt[:block] == requests[1].prompt[:block]  # hash id 1 is the same block
    assert requests[0].prompt[block:] != requests[1].prompt[block:520]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ("", "holds no requests"),
        ("{not json\n", "line 1: not JSON"),
        ('{"output_length": 3}\n', "needs a 'prompt' or an 'input_length'"),
        ('{"timestamp": 1, "prompt": "a"}\n{"prompt": "b"}\n', "every line has a timestamp"),
        ('{"input_length": 5}\n', "pass --tokenizer"),
    ],
)
def test_bad_files_name_the_flag(tmp_path: Path, lines: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(lines)
    with pytest.raises(ValueError, match=message):
        file_requests(path, None)


def test_fit_text_gives_up_gracefully_with_the_true_length(tiny_tokenizer) -> None:
    maker = PromptMaker(tiny_tokenizer, np.random.default_rng(0))
    text, length = maker.fit_text(maker.random_ids(25), 25)
    assert length == len(tiny_tokenizer.encode(text)) == 25


def _args(**overrides: object) -> argparse.Namespace:
    values = dict(
        dataset_name="random",
        dataset_path=None,
        num_prompts=3,
        seed=0,
        prompts_as_token_ids=False,
        random_input_len=12,
        random_output_len=5,
        random_range_ratio=0.0,
        random_prefix_len=0,
        prefix_repetition_prefix_len=4,
        prefix_repetition_suffix_len=4,
        prefix_repetition_num_prefixes=1,
        prefix_repetition_output_len=6,
        sharegpt_output_len=None,
        file_output_len=9,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def test_samples_from_args_dispatch_and_errors(tiny_tokenizer) -> None:
    assert [r.prompt_len for r in samples_from_args(_args(), tiny_tokenizer)] == [12, 12, 12]
    prefixed = samples_from_args(_args(dataset_name="prefix-repetition"), tiny_tokenizer)
    assert [r.expected_output_len for r in prefixed] == [6, 6, 6]
    assert len(samples_from_args(_args(dataset_name="sharegpt-like"), tiny_tokenizer)) == 3
    with pytest.raises(ValueError, match="needs a tokenizer"):
        samples_from_args(_args(), None)
    with pytest.raises(ValueError, match="--dataset-path"):
        samples_from_args(_args(dataset_name="file"), None)
    with pytest.raises(ValueError, match="--num-prompts"):
        samples_from_args(_args(num_prompts=0), tiny_tokenizer)


def _sharegpt_file(tmp_path: Path) -> Path:
    """Ten usable conversations plus ones vLLM's loader drops or prunes."""
    words = "the time people water number sound"

    def turns(*values: str) -> dict:
        return {"conversations": [{"from": f"s{i}", "value": v} for i, v in enumerate(values)]}

    usable = [turns(f"q{i} {words} {i}", " ".join(["answer"] * (5 + i)), "later turn") for i in range(10)]
    dropped = [
        turns("only one turn of the conversation"),  # fewer than 2 turns
        {"id": "no conversations key"},
        turns("hi", "a long enough reply to count"),  # prompt under 4 tokens
        turns(f"{words} {words}", "ok"),  # reply under 4 tokens
        turns(" ".join(["water"] * 1100), "a long enough reply to count"),  # prompt over 1024 tokens
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(usable[:5] + dropped + usable[5:]))
    return path


def test_sharegpt_file_takes_first_two_turns_and_prunes_as_vllm(tmp_path: Path, tiny_tokenizer) -> None:
    path = _sharegpt_file(tmp_path)
    requests = sharegpt_requests(tiny_tokenizer, str(path), num_prompts=10, seed=3)
    assert sorted(int(r.prompt.split()[0][1:]) for r in requests) == list(range(10))
    for request in requests:
        index = int(request.prompt.split()[0][1:])
        assert request.prompt_len == len(tiny_tokenizer.encode(request.prompt))
        assert request.expected_output_len == len(tiny_tokenizer.encode(" ".join(["answer"] * (5 + index))))
    # The order is Python's random.shuffle under the seed, as vLLM shuffles: reproducible, seed-dependent.
    again = sharegpt_requests(tiny_tokenizer, str(path), num_prompts=10, seed=3)
    other = sharegpt_requests(tiny_tokenizer, str(path), num_prompts=10, seed=4)
    assert again == requests and [r.prompt for r in other] != [r.prompt for r in requests]
    # A fixed output length replaces the replies' (and skips their minimum, as vLLM does).
    fixed = sharegpt_requests(tiny_tokenizer, str(path), num_prompts=20, output_len=2, seed=3)
    assert {r.expected_output_len for r in fixed} == {2}
    assert any(r.prompt.startswith("the time") for r in fixed)  # the pair with a 1-token reply is back


def test_sharegpt_with_fewer_conversations_than_asked_draws_again(
    tmp_path: Path, tiny_tokenizer, capsys: pytest.CaptureFixture
) -> None:
    path = _sharegpt_file(tmp_path)
    requests = sharegpt_requests(tiny_tokenizer, str(path), num_prompts=25)
    assert len(requests) == 25 and len({r.prompt for r in requests}) == 10
    assert "10 usable conversations" in capsys.readouterr().err
    as_ids = sharegpt_requests(tiny_tokenizer, str(path), num_prompts=2, as_token_ids=True)
    assert all(len(r.prompt) == r.prompt_len for r in as_ids)


def test_sharegpt_through_the_command_line_flags(tmp_path: Path, tiny_tokenizer) -> None:
    path = _sharegpt_file(tmp_path)
    args = _args(dataset_name="sharegpt", dataset_path=str(path), num_prompts=4, output_len=7)
    assert [r.expected_output_len for r in samples_from_args(args, tiny_tokenizer)] == [7] * 4
    with pytest.raises(ValueError, match="--dataset-path"):
        samples_from_args(_args(dataset_name="sharegpt"), tiny_tokenizer)
    (tmp_path / "bad.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="JSON list"):
        samples_from_args(
            _args(dataset_name="sharegpt", dataset_path=str(tmp_path / "bad.json")), tiny_tokenizer
        )
    prefixed = samples_from_args(_args(dataset_name="prefix_repetition"), tiny_tokenizer)  # vLLM's spelling
    assert [r.expected_output_len for r in prefixed] == [6, 6, 6]
