"""Prometheus metrics of one server, under vLLM's metric names with a `tokenmill:` prefix, so dashboards
and autoscalers written for vLLM read them unchanged. Scheduler gauges come from the engine core's
per-step stats; latencies are measured in the API process as outputs arrive.

With several API processes (`--api-server-count`) the launcher sets PROMETHEUS_MULTIPROC_DIR before it
starts them: each process writes its values to files there, and /metrics, whichever process answers it,
adds them up (prometheus_client's multiprocess mode). The core's stats are recorded by API process 0
alone, so they are counted once."""

from __future__ import annotations

import bisect
import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

from tokenmill.serving.core_protocol import SchedulerStats

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))  # vLLM's 1-2-5 series of counts

FINISH_REASONS = ("stop", "length", "abort")

# The `_created` companion series only double the scrape size; vLLM turns them off too.
disable_created_metrics()


# The offload counters by (what, direction) and the running total in SchedulerStats each follows.
_OFFLOAD_FIELDS = {
    ("blocks", "save"): "offload_saved_blocks",
    ("blocks", "load"): "offload_loaded_blocks",
    ("blocks", "spill"): "offload_spilled_blocks",
    ("blocks", "disk_read"): "offload_disk_read_blocks",
    ("bytes", "save"): "offload_bytes_saved",
    ("bytes", "load"): "offload_bytes_loaded",
    ("bytes", "spill"): "offload_bytes_spilled",
    ("bytes", "disk_read"): "offload_bytes_disk_read",
}


class BulkHistogram:
    """A Prometheus histogram that takes many equal observations in one call. The outputs of one engine
    step reach the API process together, so their inter-token gaps are a handful of distinct values;
    Histogram.observe would take a lock and a bucket search per token. It adds to the buckets of a real
    Histogram (which keeps them per bucket, not cumulative), so the multiprocess mode works unchanged."""

    def __init__(self, histogram: Histogram) -> None:
        # The histogram's own upper bounds (+Inf last) and one value per bucket; see the docstring.
        self.bounds = histogram._upper_bounds  # noqa: SLF001
        self._buckets = histogram._buckets  # noqa: SLF001
        self._sum = histogram._sum  # noqa: SLF001

    def observe(self, value: float, count: int = 1) -> None:
        index = bisect.bisect_left(self.bounds, value)  # the first bucket whose upper bound holds it
        self._buckets[index].inc(count)
        self._sum.inc(value * count)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        # Set by the launcher of several API processes before any of them imported prometheus_client.
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        labels = {"model_name": model_name, "engine": "0"}
        self._labels = labels
        names = list(labels)

        def gauge(name: str, doc: str):
            # Only API process 0 sets the core's gauges: the most recent value written is the answer.
            return Gauge(
                f"tokenmill:{name}", doc, names, registry=self.registry, multiprocess_mode="mostrecent"
            ).labels(**labels)

        def counter(name: str, doc: str):
            return Counter(f"tokenmill:{name}", doc, names, registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(f"tokenmill:{name}", doc, names, buckets=buckets, registry=self.registry).labels(
                **labels
            )

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks held by live requests."
        )
        self.kv_cache_used_blocks = gauge(
            "kv_cache_used_blocks",
            "KV blocks held by live requests (cached-but-free prefix blocks excluded).",
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.kv_offload_hits = counter(
            "kv_offload_hits", "Prompt tokens found in the prefix cache's CPU tier (loaded, not computed)."
        )
        self.kv_offload_disk_hits = counter(
            "kv_offload_disk_hits", "Of those, tokens read back from the CPU tier's disk tier first."
        )
        offload_blocks = Counter(
            "tokenmill:kv_offload_blocks",
            "KV blocks copied between the device and the CPU tier (save, load) and between the CPU tier and "
            "its disk tier (spill, disk_read).",
            [*names, "direction"], registry=self.registry,
        )  # fmt: skip
        offload_bytes = Counter(
            "tokenmill:kv_offload_bytes", "Bytes of those copies.",
            [*names, "direction"], registry=self.registry,
        )  # fmt: skip
        families = {"blocks": offload_blocks, "bytes": offload_bytes}
        self._offload = {
            (kind, direction): families[kind].labels(**labels, direction=direction)
            for kind, direction in _OFFLOAD_FIELDS
        }
        self.kv_transfer_requests = counter(
            "kv_transfer_requests",
            "Disaggregation: requests whose prompt KV was sent (prefill) or received (decode).",
        )
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "Disaggregation: bytes of KV sent or received.")
        self.kv_transfer_seconds = counter(
            "kv_transfer_seconds",
            "Disaggregation: time spent exporting KV (prefill) or waiting for it (decode).",
        )
        self.kv_offload_seconds = counter(
            "kv_offload_host_seconds", "Host time spent issuing the CPU tier's copies."
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Steps of a request that verified drafts."
        )
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._accepted_per_position = Counter(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position in the step's drafts (0: the first).",
            [*names, "position"],
            registry=self.registry,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        success = Counter(
            "tokenmill:request_success",
            "Finished requests, by finish reason.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {
            reason: success.labels(**labels, finished_reason=reason) for reason in FINISH_REASONS
        }
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS
        )
        # Before "arrival" (when the engine gets the request, as vLLM counts it): what a client's TTFT
        # holds that time_to_first_token does not.
        self.request_intake = histogram(
            "request_intake_seconds",
            "Time from a chat or completion request's handler to its arrival at the engine: the chat "
            "template, tokenization, checks, and the wait for the API process's text thread.",
            _TTFT_BUCKETS,
        )
        self.inter_token_latency = BulkHistogram(
            histogram(
                "inter_token_latency_seconds", "Time between consecutive outputs of a request.", _ITL_BUCKETS
            )
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", _REQUEST_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first being scheduled.", _REQUEST_BUCKETS
        )
        # Per finished request, as vLLM's dashboard reads them (prompt and output length heatmaps).
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of each finished request.", _TOKEN_BUCKETS
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from a request's first token to its last.", _REQUEST_BUCKETS
        )
        self._last_stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, [])
        self._cache_config = Gauge(
            "tokenmill:cache_config_info",
            "The KV cache's configuration, in labels (a router reads the block size and capacity).",
            [*names, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )

    def record_cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        self._cache_config.labels(
            **self._labels, block_size=str(block_size), num_gpu_blocks=str(num_blocks),
            enable_prefix_caching=str(enable_prefix_caching).lower(),
        ).set(1)  # fmt: skip

    def record_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.kv_cache_used_blocks.set(stats.num_used_blocks)
        # The core reports running totals; the counters advance by the difference.
        last = self._last_stats
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.kv_offload_hits.inc(stats.offload_hits - last.offload_hits)
        for key, field in _OFFLOAD_FIELDS.items():
            self._offload[key].inc(getattr(stats, field) - getattr(last, field))
        self.kv_offload_disk_hits.inc(stats.offload_disk_hits - last.offload_disk_hits)
        self.kv_offload_seconds.inc(stats.offload_seconds - last.offload_seconds)
        self.kv_transfer_requests.inc(stats.kv_transfers - last.kv_transfers)
        self.kv_transfer_bytes.inc(stats.kv_transfer_bytes - last.kv_transfer_bytes)
        self.kv_transfer_seconds.inc(stats.kv_transfer_seconds - last.kv_transfer_seconds)
        self.spec_decode_num_drafts.inc(stats.spec_num_drafts - last.spec_num_drafts)
        self.spec_decode_num_draft_tokens.inc(stats.spec_num_draft_tokens - last.spec_num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(
            stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
        )
        for position, count in enumerate(stats.spec_accepted_per_position):
            before = last.spec_accepted_per_position
            delta = count - (before[position] if position < len(before) else 0)
            if delta:
                self._accepted_per_position.labels(**self._labels, position=str(position)).inc(delta)
        for seconds in stats.queue_times:
            self.request_queue_time.observe(seconds)
        self._last_stats = stats

    def record_first_token(self, seconds: float, num_prompt_tokens: int) -> None:
        self.time_to_first_token.observe(seconds)
        self.prompt_tokens.inc(num_prompt_tokens)

    def record_intake(self, seconds: float) -> None:
        self.request_intake.observe(seconds)

    def record_step(self, inter_token_gaps: dict[float, int], num_generated_tokens: int) -> None:
        """One engine step's outputs at once: {gap in seconds: how many requests saw it}, and the
        tokens they carried."""
        for seconds, count in inter_token_gaps.items():
            self.inter_token_latency.observe(seconds, count)
        self.generation_tokens.inc(num_generated_tokens)

    def record_finished(
        self,
        finish_reason: str,
        e2e_seconds: float | None,
        num_prompt_tokens: int = 0,
        num_generation_tokens: int = 0,
        decode_seconds: float = 0.0,
    ) -> None:
        """One finished sample; an aborted one (e2e_seconds None) counts only as finished."""
        self.request_success[finish_reason].inc()
        if e2e_seconds is not None:
            self.e2e_request_latency.observe(e2e_seconds)
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(num_generation_tokens)
            self.request_decode_time.observe(decode_seconds)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)
