"""/v1/embeddings on a server started with --runner pooling (the embedded model's last-token hidden
state), through the official openai client: the same vectors as the offline engine, base64 as OpenAI
encodes it, and 400s for what a pooling server or a generating one cannot do."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from tokenmill.entrypoints.llm import LLM

from .conftest import ServerProcess

TEXTS = ["The capital of France is", "Paged attention keeps the KV cache in blocks."]


@pytest.fixture(scope="module")
def pooling_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model", "default", "--runner", "pooling", "--max-model-len", "256", "--num-kv-blocks", "64"]
    process = ServerProcess(args, tmp_path_factory.mktemp("pooling") / "server.log")
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def offline_vectors(pooling_process: ServerProcess) -> list[np.ndarray]:
    # Computed while the pooling server boots (it is started first).
    llm = LLM("default", runner="pooling", max_model_len=256, num_kv_blocks=64)
    return [np.array(o.outputs.embedding) for o in llm.embed(TEXTS, use_tqdm=False)]


@pytest.fixture(scope="module")
def pooling_server(pooling_process: ServerProcess, offline_vectors: list[np.ndarray]) -> ServerProcess:
    # offline_vectors first: the offline engine does its work while this server boots.
    return pooling_process.wait_ready()


def test_float_embeddings_match_the_offline_engine(pooling_server, offline_vectors):
    response = pooling_server.client().embeddings.create(model="default", input=TEXTS)
    assert [d.index for d in response.data] == [0, 1]
    for item, want in zip(response.data, offline_vectors, strict=True):
        got = np.array(item.embedding)
        assert got.shape == (576,)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        assert np.allclose(got, want, atol=1e-5)
    assert response.usage.prompt_tokens == response.usage.total_tokens > 0


def test_base64_and_token_id_inputs(pooling_server, offline_vectors):
    client = pooling_server.client()
    # The openai client asks for base64 by default and decodes it itself (numpy float32).
    decoded = client.embeddings.create(model="default", input=TEXTS[0]).data[0].embedding
    assert np.allclose(np.array(decoded), offline_vectors[0], atol=1e-5)
    raw = pooling_server.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()[
        "data"
    ][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(raw), dtype="<f4"), offline_vectors[0], atol=1e-5)
    token_ids = pooling_server.post("/tokenize", json={"prompt": TEXTS[1]}).json()["tokens"]
    by_ids = client.embeddings.create(model="default", input=[token_ids], encoding_format="float")
    assert np.allclose(np.array(by_ids.data[0].embedding), offline_vectors[1], atol=1e-5)


def test_what_a_pooling_server_refuses(pooling_server):
    client = pooling_server.client()
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="default", input="hi", dimensions=64)
    assert error.value.body["param"] == "dimensions" and "Matryoshka" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="default", input="word " * 400)
    assert error.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="default", input=[])
    assert error.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="default", prompt="hi", max_tokens=2)
    assert "/v1/embeddings" in error.value.body["message"]
    for bad in (
        {"input": [[10**7]]},
        {"input": "hi", "encoding_format": "bits"},
        {"input": "hi", "dimensions": 0},
        {"input": ["hi"] * 2049},
    ):
        response = pooling_server.post("/v1/embeddings", json=bad)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    # It keeps serving.
    assert len(client.embeddings.create(model="default", input="hi").data) == 1


def test_a_generating_server_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.embeddings.create(model="default", input="hi")
    assert "--runner pooling" in error.value.body["message"]


def test_metrics_count_embeddings_as_requests_not_generated_tokens(pooling_server):
    before = pooling_server.metrics()
    pooling_server.client().embeddings.create(model="default", input=["a", "b", "c"])
    after = pooling_server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    stop = next(k for k in after if k.startswith("tokenmill:request_success_total") and "stop" in k)
    assert delta(stop) == 3
    assert delta("tokenmill:generation_tokens_total") == 0
    assert delta("tokenmill:prompt_tokens_total") > 0
