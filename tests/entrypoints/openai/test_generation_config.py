"""A server started with vLLM's --generation-config and --override-generation-config: requests that leave a
sampling knob unset take the generation config's value, a request's own value wins (max_tokens: the
smaller), and the start-up log says where the defaults came from. Random weights: only behaviour counts.
The server (conftest.py's vllm_flags_server) is test_vllm_serve_flags.py's too."""

from __future__ import annotations

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_unset_knobs_take_the_generation_configs_values(vllm_flags_server):
    server = vllm_flags_server
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
