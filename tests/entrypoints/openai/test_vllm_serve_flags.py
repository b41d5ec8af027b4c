"""`tokenmill serve` started with the flags people pass to `vllm serve`, honoured as vLLM honours them: the
model as a positional argument, --chat-template (inline here), --response-role, --enable-log-requests,
--root-path, CORS (vLLM answers it by default), and the knobs that hold here whatever they say
(--trust-remote-code, --enable-chunked-prefill). Random weights: only behaviour counts. The server
(conftest.py's vllm_flags_server) is test_generation_config.py's too."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_chat_template_and_response_role(vllm_flags_server):
    server = vllm_flags_server
    rendered = server.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    plain = server.post("/tokenize", json={"prompt": "<<Hi>>", "add_special_tokens": False}).json()["tokens"]
    assert rendered == plain
    client = server.client()
    reply = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].message.role == "bot" and reply.usage.prompt_tokens == len(plain)
    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2, stream=True)
    assert next(iter(stream)).choices[0].delta.role == "bot"
    continued = client.chat.completions.create(
        model="default", messages=[*MESSAGES, {"role": "assistant", "content": "Hel"}], max_tokens=2,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )  # fmt: skip
    assert continued.choices[0].message.role == "assistant"  # the continued message's, as in vLLM
    assert "Received request chatcmpl-" in server.log_text()


def test_cors_and_root_path(vllm_flags_server):
    server = vllm_flags_server
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    models = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://example.com"})
    assert models.headers["access-control-allow-origin"] == "*"
    # Behind a proxy that keeps the prefix, as under vLLM's --root-path.
    assert httpx.get(f"{server.url}/api/v1/models").json()["data"][0]["id"] == "default"
