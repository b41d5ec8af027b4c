"""The router's HTTP side: every request is passed to one replica and its answer passed back unchanged
(status, body, streamed chunks as they come). Generation requests (chat, completions, embeddings) are
routed by the policy on their prompt's block hashes; anything else goes to the least loaded replica.

A request that fails before its replica sent any output (connection refused or reset, a 503 from a
draining or dead engine) is sent again to another replica; once output has reached the client, a failing
replica ends the stream with an error event. A client that disconnects closes the connection to the
replica, which aborts the request there and frees its KV blocks."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.router.index import PrefixIndex
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Policy
from tokenmill.router.prefix import PromptHasher
from tokenmill.router.replicas import Replica, ReplicaSet

logger = logging.getLogger("tokenmill.router")

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# Headers that describe one hop, not the request: the router's own connections set them.
_HOP_HEADERS = frozenset(
    ("host", "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
     "te", "trailer", "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding")
)  # fmt: skip
# Prompts longer than this (bytes of body) are hashed off the event loop.
_INLINE_HASH_BYTES = 16 << 10
# Bodies larger than a replica takes by default (serve's --max-request-body-bytes) are not hashed: routed
# by load, they get the replica's own 413 at once, not seconds of the router's CPU first.
_MAX_HASHED_BYTES = 8 << 20


def error_body(message: str, error_type: str, code: str) -> dict:
    return {"error": {"message": message, "type": error_type, "param": None, "code": code}}


class Router:
    def __init__(
        self, replicas: ReplicaSet, policy: Policy, hasher: PromptHasher, index: PrefixIndex
    ) -> None:
        self.replicas = replicas
        self.policy = policy
        self.hasher = hasher
        self.index = index
        self.max_hashed_bytes = _MAX_HASHED_BYTES
        self.metrics = RouterMetrics(lambda: self.replicas.replicas.values(), policy.name)
        self.session: aiohttp.ClientSession | None = None
        replicas.on_change = self._replica_changed

    def _replica_changed(self, replica: Replica, healthy: bool) -> None:
        # Down, gone, or back after a restart: either way its cache is not what the index remembers.
        self.index.drop(replica.url)
        if healthy and replica.num_blocks:
            self.index.set_capacity(replica.url, replica.num_blocks)
            if replica.block_size and replica.block_size != self.hasher.block_size and not self.hasher.fixed:
                logger.info(
                    "hashing prompts in blocks of %d tokens, as %s does", replica.block_size, replica.url
                )
                self.hasher.block_size = replica.block_size

    async def start(self) -> None:
        # No total timeout: a generation may run for minutes. Connecting is what must be quick.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.replicas.timeout_s)
        connector = aiohttp.TCPConnector(limit=0)
        self.session = aiohttp.ClientSession(timeout=timeout, connector=connector, auto_decompress=False)
        await self.replicas.start(self.session)

    async def stop(self) -> None:
        await self.replicas.stop()
        if self.session is not None:
            await self.session.close()

    def choose(self, hashes: list[int], exclude: set[str], start: float) -> Replica | None:
        """start: when the request arrived (perf_counter), so the decision time includes hashing."""
        healthy = [r for r in self.replicas.healthy() if r.url not in exclude]
        if not healthy:
            return None
        names = [r.url for r in healthy]
        matched = self.index.match(hashes, names)
        url = self.policy.choose(matched, {r.url: r.load for r in healthy})
        self.index.record(url, hashes)
        replica = self.replicas.replicas[url]
        replica.requests += 1
        self.metrics.routed(url, len(hashes), matched[url], time.perf_counter() - start)
        return replica

    async def prompt_hashes(self, path: str, body: bytes) -> list[int]:
        if path not in ROUTED_PATHS:
            return []
        if len(body) > self.max_hashed_bytes:
            return []  # routed by load alone: the replica answers a body this large itself (a 413)
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):
            return []  # the replica answers the malformed body with its own 400
        if len(body) <= _INLINE_HASH_BYTES:
            return self.hasher.hashes(path, parsed)
        return await asyncio.to_thread(self.hasher.hashes, path, parsed)

    async def forward(self, request: Request, path: str) -> Response:
        assert self.session is not None
        body = await request.body()
        start = time.perf_counter()
        hashes = await self.prompt_hashes(path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: set[str] = set()
        while True:
            replica = self.choose(hashes, tried, start)
            if replica is None:
                reason = "no replica is healthy" if not tried else "every replica failed this request"
                self.metrics.failures.labels("no_replica").inc()
                return JSONResponse(error_body(reason, "service_unavailable", "no_replica"), status_code=503)
            tried.add(replica.url)
            replica.in_flight += 1
            try:
                answer = await _until_disconnect(
                    request, self._send(request.method, replica, path, body, headers, request.query_params)
                )
            except _Retry as retry:
                replica.in_flight -= 1
                self.metrics.retries.labels(replica.url).inc()
                logger.warning(
                    "request to %s failed before any output (%s); trying another", replica.url, retry
                )
                continue
            except BaseException:
                replica.in_flight -= 1
                raise
            if answer is None:  # the client left first; the replica's connection is closed, so it aborts
                replica.in_flight -= 1
                return Response(status_code=499)
            return answer

    async def _send(self, method, replica: Replica, path, body, headers, params) -> Response:
        """The replica's answer as a response to the client: whole, or a stream that begins with the
        replica's first chunk (so that a replica failing before it is still retried elsewhere)."""
        assert self.session is not None
        try:
            upstream = await self.session.request(
                method, replica.url + path, data=body, headers=headers, params=params
            )
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            self.replicas.mark_down(replica, f"{type(exc).__name__}: {exc}")
            raise _Retry(str(exc)) from exc
        try:
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
            if upstream.status == 503 or upstream.content_type != "text/event-stream":
                data = await upstream.read()
                if upstream.status == 503 and _replica_unavailable(data):
                    # A draining or dead engine: it started nothing, another replica can take the request.
                    self.replicas.mark_down(replica, "answered 503")
                    raise _Retry("503")
                upstream.release()
                replica.in_flight -= 1
                return Response(data, status_code=upstream.status, headers=out_headers)
            first = await upstream.content.readany()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            upstream.close()
            self.replicas.mark_down(replica, f"{type(exc).__name__}: {exc}")
            raise _Retry(str(exc)) from exc
        except BaseException:
            upstream.close()
            raise
        return _UpstreamStream(self, replica, upstream, first, out_headers)


class _Retry(Exception):
    pass


# The 503 codes of a replica that takes no requests at all (not of one request it could not serve, such
# as a decode instance's prefill_failed, which passes through to the client).
_REPLICA_DOWN_CODES = ("draining", "engine_dead")


def _replica_unavailable(body: bytes) -> bool:
    """Whether a replica's 503 says the replica is down: its OpenAI error code says so, or the body is not
    a tokenmill error at all (a proxy's or a server's own 503 in front of it)."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return True
    return code in _REPLICA_DOWN_CODES


class _UpstreamStream(StreamingResponse):
    """The replica's event stream, chunk by chunk as it arrives. However the response ends (done, the
    client gone, the replica failing), the upstream connection is closed and the request counted out."""

    def __init__(self, router: Router, replica: Replica, upstream, first: bytes, headers: dict) -> None:
        self.router = router
        self.replica = replica
        self.upstream = upstream
        self.first = first
        self._closed = False
        super().__init__(self._chunks(), status_code=upstream.status, headers=headers)

    async def _chunks(self):
        yield self.first
        try:
            async for chunk in self.upstream.content.iter_any():
                yield chunk
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            self.router.replicas.mark_down(self.replica, f"{type(exc).__name__} mid-stream")
            self.router.metrics.failures.labels("replica_failed_mid_stream").inc()
            message = f"the replica serving this request failed mid-stream ({type(exc).__name__})"
            yield f"data: {json.dumps(error_body(message, 'server_error', 'replica_failed'))}\n\n".encode()
            yield b"data: [DONE]\n\n"

    def close_upstream(self) -> None:
        if not self._closed:
            self._closed = True
            self.upstream.close()
            self.replica.in_flight -= 1

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.close_upstream()


async def _until_disconnect(request: Request, work) -> Response | None:
    """Run `work` (a coroutine) unless the client disconnects first: then cancel it and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(router: Router) -> FastAPI:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    app = FastAPI(title="tokenmill router", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        if router.replicas.healthy():
            return Response(status_code=200)
        return JSONResponse(error_body("no replica is healthy", "service_unavailable", "no_replica"), 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/replicas")
    async def replicas() -> JSONResponse:
        return JSONResponse([
            {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight, "load": r.load,
             "requests": r.requests, "cached_blocks": router.index.num_blocks(r.url),
             "last_error": r.last_error}
            for r in router.replicas.replicas.values()
        ])  # fmt: skip

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def proxy(request: Request, path: str) -> Response:
        return await router.forward(request, "/" + path)

    return app
