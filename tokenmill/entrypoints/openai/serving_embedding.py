"""POST /v1/embeddings: one engine request per input, pooled by the pooling runner (--runner pooling) into
an L2-normalised vector; floats or base64 (little-endian float32, as OpenAI encodes them), `dimensions`
for Matryoshka models (the leading dimensions, normalised again)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import pooling_request_params

from .common import ServerState, final_outputs, render_input
from .errors import bad_request
from .tokenize_embed_protocol import EmbeddingRequest

_json = msgspec.json.Encoder()


def matryoshka_dimensions(hf_config: object) -> list[int] | None:
    """The output sizes a Matryoshka model allows ([] for any up to its hidden size), or None when the
    model is not one (its config says so with matryoshka_dimensions or is_matryoshka, as vLLM reads it)."""
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return [int(d) for d in dimensions]
    return [] if getattr(hf_config, "is_matryoshka", False) else None


class EmbeddingServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        hf_config = self.state.engine.hf_config
        size = hf_config.hidden_size
        allowed = matryoshka_dimensions(hf_config)
        if allowed is None:
            raise bad_request(
                "this model is not a Matryoshka model (no is_matryoshka or matryoshka_dimensions in its "
                "config): its embeddings cannot be shortened; leave dimensions out.",
                param="dimensions",
            )
        if dimensions > size or (allowed and dimensions not in allowed):
            choices = f"one of {allowed}" if allowed else f"at most {size}"
            raise bad_request(f"dimensions must be {choices}, got {dimensions}.", param="dimensions")

    def _prepare(self, request: EmbeddingRequest) -> list[list[int]]:
        engine = self.state.engine
        all_ids = []
        for index, item in enumerate(request.inputs()):
            token_ids = render_input(engine.tokenizer, item, index, "input").token_ids
            if request.truncate_prompt_tokens is not None:
                token_ids = token_ids[-request.truncate_prompt_tokens :]
            if len(token_ids) > engine.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {engine.max_model_len} tokens. However, input "
                    f"{index} is {len(token_ids)} tokens. Please reduce the length of the input (or set "
                    "truncate_prompt_tokens).",
                    param="input",
                    code="context_length_exceeded",
                )
            all_ids.append(token_ids)
        return all_ids

    async def create(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        state = self.state
        model = state.check_model(request.model)
        engine = state.engine
        if engine.pooling_type is None:
            raise bad_request(
                "this server generates text; /v1/embeddings needs a model served with --runner pooling.",
                param="model",
            )
        state.check_accepting()
        self._check_dimensions(request.dimensions)
        all_ids = await state.off_loop(self._prepare, request)
        params = pooling_request_params()
        for token_ids in all_ids:
            engine.input_processor.check(token_ids, params)
        base_id = f"embd-{uuid.uuid4().hex}"
        streams: dict[str, AsyncIterator[RequestOutput]] = {}
        try:
            for index, token_ids in enumerate(all_ids):
                request_id = f"{base_id}-{index}"
                streams[request_id] = engine.add_request(request_id, token_ids, params)
        except Exception:
            for request_id in streams:
                engine.abort(request_id)
            raise
        finals = await final_outputs(engine, streams, raw_request)
        data = [
            {"object": "embedding", "embedding": self._encode(final, request), "index": index}
            for index, final in enumerate(finals)
        ]
        num_tokens = sum(len(ids) for ids in all_ids)
        body = {
            "id": base_id,
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
        return Response(_json.encode(body), media_type="application/json")

    @staticmethod
    def _encode(final: RequestOutput, request: EmbeddingRequest) -> list[float] | str:
        assert final.pooled is not None, "a pooling request finished without its vector"
        raw = final.pooled
        if request.dimensions is not None:
            vector = np.frombuffer(raw, dtype="<f4")[: request.dimensions]
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
            raw = vector.astype("<f4").tobytes()
        if request.encoding_format == "base64":
            return base64.b64encode(raw).decode()
        return np.frombuffer(raw, dtype="<f4").tolist()
