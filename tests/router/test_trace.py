"""The simulator's traces: block hashes as the engine and the router compute them, the synthetic chats'
shared and growing prefixes, and a recorded JSONL trace's three ways of giving a prompt."""

from __future__ import annotations

import json

import pytest

from tokenmill.router.prefix import chain
from tokenmill.router.trace import Conversation, read_trace, synthetic_trace


def test_a_conversation_hashes_its_text_as_prefix_chain_does_however_it_is_appended():
    tokens = [7 * i % 1000 for i in range(203)]
    conversation = Conversation(16)
    for start, end in [(0, 5), (5, 16), (16, 17), (17, 100), (100, 203)]:
        conversation.extend(tokens[start:end])
    assert conversation.block_hashes == chain(tokens, 16)
    assert conversation.length == 203


def _synthetic(**overrides):
    options = dict(
        conversations=20, turns=3, rate=10.0, system_prompt_len=100, num_system_prompts=2,
        user_turn_len=40, output_len=30, think_time_s=5.0, block_size=16, seed=0,
    )  # fmt: skip
    return synthetic_trace(**{**options, **overrides})


def test_synthetic_turns_extend_the_last_prompt_and_answer_and_chats_share_system_prompts():
    sessions = _synthetic()
    assert len(sessions) == 20
    assert [session.start_s for session in sessions] == sorted(session.start_s for session in sessions)
    system_blocks = set()
    for session in sessions:
        assert len(session.turns) == 3 and len(session.think_s) == 2
        for before, after in zip(session.turns, session.turns[1:]):
            # The next prompt is this prompt, its answer and a new user message of 20 to 60 tokens.
            assert 20 <= after.prompt_len - before.prompt_len - before.output_len <= 60
            assert after.prompt_hashes(16)[: before.num_blocks] == before.block_hashes[: before.num_blocks]
        system_blocks.add(tuple(session.turns[0].block_hashes[: 100 // 16]))
    assert len(system_blocks) == 2


def test_synthetic_traces_are_the_same_for_a_seed():
    first, again, other = _synthetic(), _synthetic(), _synthetic(seed=1)
    assert [s.start_s for s in first] == [s.start_s for s in again]
    assert [t.block_hashes[: t.num_blocks] for s in first for t in s.turns] == [
        t.block_hashes[: t.num_blocks] for s in again for t in s.turns
    ]
    assert [s.start_s for s in first] != [s.start_s for s in other]


def _write(tmp_path, records):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    return path


def test_a_recorded_trace_gives_prompts_as_token_ids_shared_prefixes_or_conversations(tmp_path):
    path = _write(
        tmp_path,
        [
            {"timestamp": 100.5, "prompt_token_ids": list(range(40)), "output_len": 4},
            {"timestamp": 101.0, "prompt_len": 80, "prefix_id": "sys-a", "prefix_len": 64, "output_len": 2},
            {"timestamp": 101.5, "prompt_len": 90, "prefix_id": "sys-a", "prefix_len": 64, "output_len": 2},
            {"timestamp": 102.0, "prompt_len": 80, "prefix_id": "sys-b", "prefix_len": 64, "output_len": 2},
            {"timestamp": 103.0, "conversation_id": "c", "prompt_len": 50, "output_len": 20},
            {"timestamp": 109.0, "conversation_id": "c", "prompt_len": 100, "output_len": 5},
        ],
    )
    sessions = read_trace(path, 16)
    assert [session.start_s for session in sessions] == [0.0, 0.5, 1.0, 1.5, 2.5, 8.5]
    ids, sys_a, sys_a_again, sys_b, turn, next_turn = [session.turns[0] for session in sessions]
    assert ids.prompt_hashes(16) == chain(list(range(40)), 16)
    assert (ids.prompt_len, ids.output_len, ids.num_blocks) == (40, 4, 2)
    assert sys_a.prompt_hashes(16)[:4] == sys_a_again.prompt_hashes(16)[:4]  # 64 shared tokens
    assert sys_a.prompt_hashes(16)[4] != sys_a_again.prompt_hashes(16)[4]  # then each its own text
    assert not set(sys_b.prompt_hashes(16)) & set(sys_a.prompt_hashes(16))
    # The second turn starts with the first turn's prompt and answer (70 tokens: 4 full blocks).
    assert next_turn.prompt_hashes(16)[:4] == turn.block_hashes[:4]
    assert next_turn.prompt_len == 100


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"timestamp": 0, "prompt_len": 5}], "line 1: no 'output_len'"),
        ([{"timestamp": 0, "output_len": 3}], "line 1: no 'prompt_len'"),
        ([{"timestamp": 0, "prompt_len": 5, "output_len": 0}], "line 1: output_len must be >= 1"),
        ([{"timestamp": 0, "prompt_token_ids": [], "output_len": 3}], "line 1: the prompt is empty"),
        (
            [
                {"timestamp": 0, "conversation_id": "c", "prompt_len": 50, "output_len": 20},
                {"timestamp": 1, "conversation_id": "c", "prompt_len": 60, "output_len": 20},
            ],
            "line 2: prompt_len 60 is shorter than conversation 'c' so far",
        ),
        ([], "holds no requests"),
    ],
)
def test_a_bad_trace_line_is_a_value_error_naming_the_line(tmp_path, records, message):
    with pytest.raises(ValueError, match=message):
        read_trace(_write(tmp_path, records), 16)


def test_a_missing_trace_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="--trace .*cannot read it"):
        read_trace(tmp_path / "absent.jsonl", 16)
