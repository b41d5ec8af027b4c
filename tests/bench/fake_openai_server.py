"""A real HTTP server on 127.0.0.1 that streams OpenAI chunks on a scripted timetable, for bench tests."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web


@dataclass(frozen=True)
class Script:
    """How to answer one request: first token after `ttft_s`, then one token every `itl_s`."""

    ttft_s: float = 0.05
    itl_s: float | Sequence[float] = 0.01
    num_tokens: int = 4
    status: int = 200  # anything else: an OpenAI error object with this HTTP status, at once
    error_after: int | None = None  # stream this many tokens, then an error event
    drop_after: int | None = None  # stream this many tokens, then close the connection mid-stream
    usage_tokens: int | None = None  # completion_tokens in the usage chunk (default: one per chunk)
    usage_delay_s: float = 0.0  # wait this long after the finish chunk before the usage chunk and [DONE]
    send_usage: bool = True
    message: str = "scripted failure"

    def gaps(self) -> list[float]:
        if isinstance(self.itl_s, int | float):
            return [float(self.itl_s)] * (self.num_tokens - 1)
        return list(self.itl_s)


class FakeOpenAIServer:
    """Serves /v1/completions, /v1/chat/completions and /v1/models from a background thread."""

    def __init__(
        self, script_for: Callable[[dict], Script], model: str = "fake-model", root: str | None = None
    ) -> None:
        self.script_for = script_for
        self.model = model
        self.root = root
        self.payloads: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _models(self, request: web.Request) -> web.Response:
        listed = {"id": self.model, "object": "model", **({"root": self.root} if self.root else {})}
        return web.json_response({"object": "list", "data": [listed]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        self.headers.append(dict(request.headers))
        script = self.script_for(payload)
        if script.status != 200:
            error = {"message": script.message, "type": "BadRequestError", "code": script.status}
            return web.json_response({"error": error}, status=script.status)
        chat = request.path.endswith("/chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        if chat:  # a role-only delta first, as OpenAI sends: it carries no token
            await _send(response, _chunk(chat, None, role=True))
        send_times = [script.ttft_s]
        for gap in script.gaps():
            send_times.append(send_times[-1] + gap)
        for index, offset in enumerate(send_times):
            await asyncio.sleep(max(0.0, start + offset - loop.time()))
            if script.error_after == index:
                await _send(response, {"error": {"message": script.message, "type": "InternalServerError"}})
                return response
            if script.drop_after == index:
                request.transport.close()  # no terminating chunk: the client sees a broken stream
                return response
            await _send(response, _chunk(chat, f" t{index}"))
        await _send(response, _chunk(chat, None, finish=True))
        await asyncio.sleep(script.usage_delay_s)
        if script.send_usage and (payload.get("stream_options") or {}).get("include_usage"):
            prompt = payload.get("prompt") or payload["messages"][-1]["content"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            completion_tokens = script.usage_tokens or script.num_tokens
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            await _send(response, {"id": "x", "choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        return response


def _chunk(chat: bool, text: str | None, *, role: bool = False, finish: bool = False) -> dict:
    if chat:
        delta: dict = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": "length" if finish else None}
        return {"id": "x", "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text or "", "finish_reason": "length" if finish else None}
    return {"id": "x", "object": "text_completion", "choices": [choice]}


async def _send(response: web.StreamResponse, data: dict) -> None:
    await response.write(f"data: {json.dumps(data)}\n\n".encode())
