"""The server's plain ASGI middlewares (they must not buffer streaming responses): the API-key check and
the request-body cap."""

from __future__ import annotations

import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import OpenAIError


class ApiKeyCheck:
    """A plain ASGI middleware (it must not buffer streaming responses): every path but the probes and
    /metrics needs `Authorization: Bearer <key>` (the scheme in any case, as RFC 7235 has it)."""

    OPEN_PATHS = ("/health", "/version", "/metrics")

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in self.OPEN_PATHS:
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = OpenAIError(
                    401, "Invalid API key: send it as `Authorization: Bearer <key>`.", code="invalid_api_key"
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimit:
    """A plain ASGI middleware capping request bodies: a declared Content-Length over the cap is a 413
    before anything is read; a chunked body is counted as it arrives and stopped at the cap."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> str:
        return f"request body over {self.max_bytes} bytes (--max-request-body-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            error = OpenAIError(413, self._too_large(), code="request_too_large")
            await error.response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises HTTPExceptions met while reading a body; the handler answers it.
                    raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counted, send)
