"""The replicas behind the router: a static list (`--backend URL`) and/or the addresses a DNS name
resolves to (`--discover HOST:PORT`, e.g. a Kubernetes headless Service, re-resolved so scaling needs
no restart). A background loop checks each one's /health and reads its /metrics: requests running and
waiting (the load signal beside the router's own count of requests in hand), the engine's prefix-cache
counters (to set against the router's estimate), and its KV block size and capacity."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("tokenmill.router")


@dataclass
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0  # requests this router has sent and not seen finish
    others: float = 0.0  # requests in hand from other clients, as of the last /metrics
    prefix_cache_hits: float = 0.0
    prefix_cache_queries: float = 0.0
    block_size: int | None = None
    num_blocks: int | None = None
    requests: int = 0  # routed here
    last_error: str = ""

    @property
    def load(self) -> float:
        """Requests in hand: the router's own, counted live, plus other clients' (other routers'), which
        the replica's gauges showed at the last scrape."""
        return self.in_flight + self.others


def _scrape(text: str, replica: Replica) -> None:
    running = waiting = hits = queries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "tokenmill:num_requests_running":
                running += sample.value
            elif name == "tokenmill:num_requests_waiting":
                waiting += sample.value
            elif name == "tokenmill:prefix_cache_hits_total":
                hits += sample.value
            elif name == "tokenmill:prefix_cache_queries_total":
                queries += sample.value
            elif name == "tokenmill:cache_config_info":
                replica.block_size = int(sample.labels["block_size"])
                replica.num_blocks = int(sample.labels["num_gpu_blocks"])
    replica.others = max(0.0, running + waiting - replica.in_flight)
    replica.prefix_cache_hits, replica.prefix_cache_queries = hits, queries


class ReplicaSet:
    def __init__(
        self,
        backends: list[str],
        discover: list[str],
        interval_s: float = 2.0,
        timeout_s: float = 5.0,
        on_change: Callable[[Replica, bool], None] | None = None,
    ) -> None:
        """on_change(replica, healthy): called when a replica comes up or goes down (or disappears)."""
        if not backends and not discover:
            raise ValueError("give the router at least one --backend URL or --discover HOST:PORT")
        self.static = [_normalise(url) for url in backends]
        self.discover = [_host_port(target) for target in discover]
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.replicas: dict[str, Replica] = {url: Replica(url) for url in self.static}
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    def healthy(self) -> list[Replica]:
        return [replica for replica in self.replicas.values() if replica.healthy]

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        await self.refresh()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def mark_down(self, replica: Replica, reason: str) -> None:
        """A request could not reach it: out of rotation until its /health answers again."""
        replica.last_error = reason
        if replica.healthy:
            logger.warning("replica %s is down: %s", replica.url, reason)
            replica.healthy = False
            if self.on_change is not None:
                self.on_change(replica, False)

    async def refresh(self) -> None:
        await self._resolve()
        await asyncio.gather(*(self._check(replica) for replica in list(self.replicas.values())))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # the loop must outlive any one bad answer
                logger.exception("replica refresh failed")

    async def _resolve(self) -> None:
        if not self.discover:
            return
        loop = asyncio.get_running_loop()
        found = set(self.static)
        for host, port in self.discover:
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                logger.warning("cannot resolve %s: %s", host, exc)
                # Keep what it resolved to before: a DNS hiccup is not every replica dying.
                found |= {url for url in self.replicas if url.endswith(f":{port}")}
                continue
            for family, _, _, _, address in infos:
                ip = address[0]
                found.add(f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}")
        for url in found - set(self.replicas):
            self.replicas[url] = Replica(url)
        for url in set(self.replicas) - found:
            replica = self.replicas.pop(url)
            logger.info("replica %s left the pool", url)
            if self.on_change is not None:
                self.on_change(replica, False)

    async def _check(self, replica: Replica) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with self._session.get(replica.url + "/health", timeout=timeout) as response:
                ok = response.status == 200
                reason = f"/health answered {response.status}"
            if ok:
                async with self._session.get(replica.url + "/metrics", timeout=timeout) as response:
                    if response.status == 200:
                        _scrape(await response.text(), replica)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            ok, reason = False, f"{type(exc).__name__}: {exc}"
        if ok and not replica.healthy:
            logger.info("replica %s is up", replica.url)
            replica.healthy, replica.last_error = True, ""
            if self.on_change is not None:
                self.on_change(replica, True)
        elif not ok:
            self.mark_down(replica, reason)


def _normalise(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url.removesuffix("/v1")


def _host_port(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--discover takes HOST:PORT, got {target!r}")
    return host, int(port)
