"""`tokenmill serve` started with the flags people pass to `vllm serve`, honoured as vLLM honours them: the
model as a positional argument, --chat-template (inline here), --response-role, --enable-log-requests,
--root-path, CORS (vLLM answers it by default), and the knobs that hold here whatever they say
(--trust-remote-code, --enable-chunked-prefill). Random weights: only behaviour counts."""

from __future__ import annotations

import httpx
import pytest

from .conftest import ServerProcess

TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["default", "--load-format", "dummy", "--max-model-len", "256", "--num-kv-blocks", "64"]
    args += ["--chat-template", TEMPLATE, "--response-role", "bot", "--enable-log-requests"]
    args += ["--root-path", "/api", "--trust-remote-code", "--enable-chunked-prefill"]
    args += ["--uvicorn-log-level", "warning"]
    process = ServerProcess(args, tmp_path_factory.mktemp("vllm_flags") / "server.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def test_chat_template_and_response_role(server):
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


def test_cors_and_root_path(server):
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    models = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://example.com"})
    assert models.headers["access-control-allow-origin"] == "*"
    # Behind a proxy that keeps the prefix, as under vLLM's --root-path.
    assert httpx.get(f"{server.url}/api/v1/models").json()["data"][0]["id"] == "default"
