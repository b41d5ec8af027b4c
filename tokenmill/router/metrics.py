"""The router's own Prometheus metrics: where requests went, how long each decision took, the prefix
hits the router expected against the ones the engines report, and each replica's health and load."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from tokenmill.router.replicas import Replica

_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class _ReplicaCollector:
    """Gauges read from the replica set at scrape time."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]]) -> None:
        self.replicas = replicas

    def collect(self):
        gauges = {
            "healthy": ("Whether the replica answers /health.", lambda r: float(r.healthy)),
            "in_flight": ("Requests sent to the replica and not finished.", lambda r: r.in_flight),
            "load": ("The load the policy sees: requests in hand.", lambda r: r.load),
            "engine_prefix_cache_hits": (
                "Prompt tokens the replica's engine found in its prefix cache (its own counter).",
                lambda r: r.prefix_cache_hits,
            ),
            "engine_prefix_cache_queries": (
                "Prompt tokens the replica's engine looked up (its own counter).",
                lambda r: r.prefix_cache_queries,
            ),
        }
        replicas = list(self.replicas())
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"tokenmill:router_replica_{name}", doc, labels=["replica"])
            for replica in replicas:
                family.add_metric([replica.url], value(replica))
            yield family


class RouterMetrics:
    def __init__(self, replicas: Callable[[], Iterable[Replica]], policy: str) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokenmill:router_requests", "Requests routed, by replica and policy.", ["replica", "policy"],
            registry=self.registry,
        )  # fmt: skip
        self.policy = policy
        self.retries = Counter(
            "tokenmill:router_retries", "Requests sent again elsewhere after a replica failed them before "
            "any output.", ["replica"], registry=self.registry,
        )  # fmt: skip
        self.failures = Counter(
            "tokenmill:router_failed_requests", "Requests the router answered with an error of its own.",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.decision_seconds = Histogram(
            "tokenmill:router_decision_seconds", "Time to pick a replica (prompt hashing included).",
            buckets=_DECISION_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.prompt_blocks = Counter(
            "tokenmill:router_prompt_blocks", "Full prompt blocks of routed requests.", registry=self.registry
        )
        self.estimated_hit_blocks = Counter(
            "tokenmill:router_estimated_hit_blocks",
            "Prompt blocks the router expected the chosen replica to hold in its prefix cache.",
            registry=self.registry,
        )
        self.registry.register(_ReplicaCollector(replicas))

    def routed(self, replica: str, prompt_blocks: int, hit_blocks: int, seconds: float) -> None:
        self.requests.labels(replica, self.policy).inc()
        self.prompt_blocks.inc(prompt_blocks)
        self.estimated_hit_blocks.inc(hit_blocks)
        self.decision_seconds.observe(seconds)
