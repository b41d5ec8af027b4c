"""OpenAI-style errors: every failure is `{"error": {"message", "type", "param", "code"}}` with the status
code an OpenAI client expects (400 bad input, 401 key, 404 model, 429 queue full, 503 unavailable)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenmill.serving.core_link import (
    EngineDeadError,
    EngineOverloadedError,
    KVTransferError,
    RequestFailedError,
)

logger = logging.getLogger("tokenmill.server")


class OpenAIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> OpenAIError:
    return OpenAIError(503, message, "service_unavailable", code=code)


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map what the engine client and the validators raise onto the HTTP status a client expects."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return OpenAIError(429, str(exc), "rate_limit_error", code="queue_full")
    if isinstance(exc, EngineDeadError):
        return unavailable(str(exc), "engine_dead")
    if isinstance(exc, KVTransferError):
        return unavailable(f"the prompt's KV never came from the prefill peer ({exc})", "kv_transfer_failed")
    if isinstance(exc, RequestFailedError):
        return OpenAIError(500, str(exc), "internal_error", code="request_failed")
    if isinstance(exc, ParamError):
        return bad_request(str(exc), param=exc.param)
    if isinstance(exc, ValueError):  # a check's ValueError names its knob where it knows it
        return bad_request(str(exc), param=getattr(exc, "param", None))
    logger.error("internal error", exc_info=exc)
    return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")


class ParamError(ValueError):
    """A check across fields (a model validator) that knows which request field is wrong: the 400's
    `param` names it, as it does for a single field's own constraint."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list"))


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    first = exc.errors()[0]
    # Drop "body" and pydantic's union-member tags ("str", "list[int]") from the location.
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    if first.get("type") == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    cause = first.get("ctx", {}).get("error")
    if not location and cause is None:  # the body itself: absent, not JSON, or JSON but not an object
        if isinstance(first.get("input"), bytes):
            return bad_request("the request body must be JSON, sent with Content-Type: application/json")
        return bad_request("the request body must be a JSON object")
    # A check across fields names its field, but its input is the whole request: not echoed back.
    echo_input = bool(location) and "input" in first and first["type"] != "missing"
    if not location and isinstance(cause, ParamError):
        location = [cause.param]
    param = ".".join(location) or None
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
        if echo_input:
            message += f" (got {json.dumps(first['input'], default=str)[:200]})"
    return bad_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    async def openai_error(_: Request, exc: Exception) -> JSONResponse:
        return to_openai_error(exc).response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_error(exc).response()

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), error_type).response()

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    # Known failures go through the exception middleware; anything else reaches the server-error
    # middleware, which answers with the same shape, logs the traceback and raises it again: uvicorn then
    # drops the connection, so a request the engine ended as failed (RequestFailedError, a 500 of its
    # own) is a known failure too, and the client's keep-alive connection serves its next request.
    known = (OpenAIError, ValueError, EngineOverloadedError, EngineDeadError, RequestFailedError)
    for error_class in (*known, Exception):
        app.add_exception_handler(error_class, openai_error)
