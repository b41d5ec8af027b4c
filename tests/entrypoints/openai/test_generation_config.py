"""A server started with vLLM's --generation-config and --override-generation-config: requests that leave a
sampling knob unset take the generation config's value, a request's own value wins (max_tokens: the
smaller), and the start-up log says where the defaults came from. Random weights: only behaviour counts."""

from __future__ import annotations

import json

import pytest

from .conftest import ServerProcess

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("generation_config")
    config = {"temperature": 0.0, "top_p": 0.9, "max_new_tokens": 3, "do_sample": True, "eos_token_id": 2}
    (directory / "generation_config.json").write_text(json.dumps(config))
    args = ["--model", "default", "--load-format", "dummy", "--max-model-len", "256", "--num-kv-blocks", "64"]
    args += ["--generation-config", str(directory), "--override-generation-config", '{"max_new_tokens": 4}']
    process = ServerProcess(args, directory / "server.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_unset_knobs_take_the_generation_configs_values(server):
    client = server.client()
    extra = {"ignore_eos": True}
    default = client.chat.completions.create(model="default", messages=MESSAGES, n=2, extra_body=extra)
    # max_new_tokens 4 (the override's), temperature 0 (the file's): two identical greedy choices.
    assert default.usage.completion_tokens == 8
    assert default.choices[0].message.content == default.choices[1].message.content
    capped = client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=50, extra_body=extra
    )
    assert capped.usage.completion_tokens == 4  # vLLM takes the smaller of the request's and the config's
    shorter = client.completions.create(model="default", prompt="a", max_tokens=2, extra_body=extra)
    assert shorter.usage.completion_tokens == 2
    sampled = client.chat.completions.create(
        model="default", messages=MESSAGES, n=4, temperature=1.0, extra_body=extra
    )
    assert len({choice.message.content for choice in sampled.choices}) > 1  # the request's temperature
    assert "default sampling parameters from the generation config" in server.log_text()
