"""A request the core ended as failed (EngineCoreOutput.error) reaches an HTTP client as its kind of error:
a grammar that failed mid-answer a 500, a KV that never came from the prefill peer a 503."""

from __future__ import annotations

from tokenmill.entrypoints.openai.errors import to_openai_error
from tokenmill.serving.core_link import KVTransferError, RequestFailedError, request_failure


def test_a_failed_request_is_its_kind_of_http_error() -> None:
    grammar = request_failure("structured_outputs: the grammar failed with the answer's first 2 tokens (...)")
    assert isinstance(grammar, RequestFailedError) and not isinstance(grammar, KVTransferError)
    error = to_openai_error(grammar)
    assert (error.status_code, error.code) == (500, "request_failed")
    assert error.body()["error"]["message"].startswith("structured_outputs: the grammar failed")
    kv = to_openai_error(request_failure("no answer from tcp://peer within 30 s"))
    assert (kv.status_code, kv.code) == (503, "kv_transfer_failed")


def test_a_failed_request_leaves_the_connection_serving() -> None:
    """The server-error middleware answers an unknown exception and raises it again (uvicorn then drops
    the keep-alive connection); a request the core ended as failed is a known failure, answered and done."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from tokenmill.entrypoints.openai.errors import install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.get("/fails")
    async def fails() -> None:
        raise request_failure("structured_outputs: the grammar failed with the answer's first 0 tokens (x)")

    @app.get("/kv")
    async def kv() -> None:
        raise request_failure("no answer from tcp://peer within 30 s")

    client = TestClient(app)  # raises what the app raises again, as uvicorn would see it
    response = client.get("/fails")
    assert response.status_code == 500 and response.json()["error"]["code"] == "request_failed"
    assert client.get("/kv").json()["error"]["code"] == "kv_transfer_failed"
