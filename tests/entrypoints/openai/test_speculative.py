"""A server started with --speculative-config answers as the plain server does (greedy, fp32), streams
several tokens per step where drafts are accepted, and reports the drafts' acceptance in /metrics."""

from __future__ import annotations

import json

from tests.entrypoints.openai.conftest import MAIN_SERVER_ARGS, ServerProcess

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
PASSAGE = "The mill stood where the river narrows and drops over a shelf of dark stone, and its wheel turned."


def test_speculative_server_matches_the_plain_one(client, tmp_path) -> None:
    messages = [{"role": "user", "content": f"Repeat exactly: {PASSAGE}"}]
    # Started first: it boots while the plain server answers (one torch thread, a core left idle).
    process = ServerProcess([*MAIN_SERVER_ARGS, "--speculative-config", SPEC], tmp_path / "spec.log")
    try:
        want = client.chat.completions.create(
            model="default", messages=messages, max_tokens=48, temperature=0
        )
        spec = process.wait_ready().client()
        got = spec.chat.completions.create(model="default", messages=messages, max_tokens=48, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.completion_tokens == want.usage.completion_tokens
        stream = spec.chat.completions.create(
            model="default", messages=messages, max_tokens=48, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == want.choices[0].message.content
        metrics = process.metrics()
        assert metrics["tokenmill:spec_decode_num_drafts_total"] > 0
        assert (
            0
            < metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
            <= (metrics["tokenmill:spec_decode_num_draft_tokens_total"])
        )
    finally:
        process.stop()
