"""The server with --tensor-parallel-size 3 on the embedded SmolLM2 (9 query heads, 3 KV heads): a chat
completion through the official openai client writes the tokens one process writes; on shutdown the
other ranks' processes are gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.entrypoints.openai.conftest import ServerProcess, wait_for
from tokenmill import LLM, SamplingParams


def rank_processes() -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:
            continue
        if b"tokenmill.worker.tp_executor" in text:
            found.append(cmdline.parent.name)
    return found


@pytest.mark.slow  # three ranks loading on a small CPU: `make test-all` or -m slow
def test_chat_on_three_ranks_equals_one_process(tmp_path) -> None:
    args = [
        "--model",
        "default",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        "--tensor-parallel-size",
        "3",
    ]
    server = ServerProcess(args, tmp_path / "server.log").wait_ready()
    messages = [{"role": "user", "content": "Name three colors."}]
    try:
        assert len(rank_processes()) == 2
        reply = server.client().chat.completions.create(
            model="default", messages=messages, max_tokens=12, temperature=0
        )
    finally:
        server.stop()
    llm = LLM("default", max_model_len=512, dtype="float32")
    (alone,) = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    assert reply.choices[0].message.content == alone.outputs[0].text
    assert wait_for(lambda: not rank_processes(), timeout=10)
