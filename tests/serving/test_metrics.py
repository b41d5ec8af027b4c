"""Server metrics: vLLM's names under `tokenmill:`, gauges set from core stats, counters advanced by the
difference of the core's running totals."""

from __future__ import annotations

from tokenmill.serving.core_protocol import SchedulerStats
from tokenmill.serving.metrics import ServerMetrics

LABELS = {"model_name": "m", "engine": "0"}


def value(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"tokenmill:{name}", {**LABELS, **labels})


def test_stats_set_gauges_and_advance_counters_by_the_difference():
    metrics = ServerMetrics("m")
    metrics.record_stats(SchedulerStats(4, 2, 0.25, 10, 100, 32, 1, [0.5, 1.5]))
    metrics.record_stats(SchedulerStats(1, 0, 0.0, 0, 180, 64, 1, []))
    assert value(metrics, "num_requests_running") == 1 and value(metrics, "num_requests_waiting") == 0
    assert value(metrics, "kv_cache_usage_perc") == 0 and value(metrics, "kv_cache_used_blocks") == 0
    assert value(metrics, "prefix_cache_queries_total") == 180
    assert value(metrics, "prefix_cache_hits_total") == 64
    assert value(metrics, "num_preemptions_total") == 1
    assert value(metrics, "request_queue_time_seconds_count") == 2
    assert value(metrics, "request_queue_time_seconds_sum") == 2.0


def test_request_metrics():
    metrics = ServerMetrics("m")
    metrics.record_first_token(0.2, num_prompt_tokens=7)
    metrics.record_step({0.05: 1}, num_generated_tokens=2)
    metrics.record_finished("length", 0.3)
    metrics.record_finished("abort", None)
    assert value(metrics, "prompt_tokens_total") == 7 and value(metrics, "generation_tokens_total") == 2
    assert value(metrics, "time_to_first_token_seconds_count") == 1
    assert value(metrics, "inter_token_latency_seconds_sum") == 0.05
    assert value(metrics, "request_success_total", finished_reason="length") == 1
    assert value(metrics, "request_success_total", finished_reason="abort") == 1
    assert value(metrics, "request_success_total", finished_reason="stop") == 0
    assert value(metrics, "e2e_request_latency_seconds_count") == 1  # aborts have no end-to-end latency
    text = metrics.render().decode()
    assert 'tokenmill:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' in text
    assert "_created" not in text


def test_one_step_records_many_gaps_into_the_right_buckets():
    metrics = ServerMetrics("m")
    # 250 requests saw a 10 ms gap this step, 6 saw 0.3 s (they were just resumed), 1 a 100 s stall.
    metrics.record_step({0.01: 250, 0.3: 6, 100.0: 1}, num_generated_tokens=257)
    metrics.record_step({0.02: 3}, num_generated_tokens=3)

    def bucket(le: str) -> float | None:
        return value(metrics, "inter_token_latency_seconds_bucket", le=le)

    assert bucket("0.01") == 250  # an upper bound holds the values equal to it
    assert bucket("0.025") == 253 and bucket("0.2") == 253 and bucket("0.3") == 259
    assert bucket("80.0") == 259 and bucket("+Inf") == 260
    assert value(metrics, "inter_token_latency_seconds_count") == 260
    assert abs(value(metrics, "inter_token_latency_seconds_sum") - (2.5 + 1.8 + 100 + 0.06)) < 1e-9
    assert value(metrics, "generation_tokens_total") == 260
    text = metrics.render().decode()
    assert "# TYPE tokenmill:inter_token_latency_seconds histogram" in text
    assert 'tokenmill:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 260.0' in text


RECORD = """
import sys
from tokenmill.serving.core_protocol import SchedulerStats
from tokenmill.serving.metrics import ServerMetrics
metrics = ServerMetrics("m")
if sys.argv[1] == "0":  # API process 0 records the core's stats
    metrics.record_stats(SchedulerStats(3, 1, 0.5, 7, 100, 40, 2, [0.2]))
metrics.record_first_token(0.02, num_prompt_tokens=10)
metrics.record_step({0.01: 5, 0.3: 1}, num_generated_tokens=6)
metrics.record_finished("length", 1.0)
if sys.argv[1] == "render":
    sys.stdout.write(metrics.render().decode())
"""


def test_several_api_processes_add_up_in_one_scrape(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR set (the launcher of --api-server-count N does it), each process's
    counters and histograms, the bulk inter-token one included, add up in whichever process renders;
    the core's gauges and counters, recorded by process 0 alone, are counted once."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for role in ("0", "1"):
        subprocess.run([sys.executable, "-c", RECORD, role], env=env, check=True)
    text = subprocess.run(
        [sys.executable, "-c", RECORD, "render"], env=env, check=True, capture_output=True, text=True
    ).stdout
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def scraped(name: str, **labels: str) -> float:
        wanted = {**LABELS, **labels}
        (found,) = [s.value for s in samples if s.name == f"tokenmill:{name}" and s.labels == wanted]
        return found

    assert scraped("num_requests_running") == 3 and scraped("kv_cache_used_blocks") == 7
    assert scraped("prefix_cache_hits_total") == 40 and scraped("request_queue_time_seconds_count") == 1
    assert scraped("prompt_tokens_total") == 30  # three processes recorded 10 each
    assert scraped("generation_tokens_total") == 18
    assert scraped("inter_token_latency_seconds_bucket", le="0.01") == 15
    assert scraped("inter_token_latency_seconds_bucket", le="+Inf") == 18
    assert scraped("inter_token_latency_seconds_count") == 18
    assert scraped("request_success_total", finished_reason="length") == 3


def test_speculative_decoding_counters():
    metrics = ServerMetrics("m")
    metrics.record_stats(SchedulerStats(1, 0, 0.1, 2, 0, 0, 0, [], 3, 12, 7, [3, 2, 2]))
    metrics.record_stats(SchedulerStats(1, 0, 0.1, 2, 0, 0, 0, [], 5, 20, 10, [5, 3, 2, 0]))
    assert value(metrics, "spec_decode_num_drafts_total") == 5
    assert value(metrics, "spec_decode_num_draft_tokens_total") == 20
    assert value(metrics, "spec_decode_num_accepted_tokens_total") == 10
    per_position = [
        value(metrics, "spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)
    ]
    assert per_position == [5, 3, 2]


def test_kv_offload_counters_and_cache_config():
    metrics = ServerMetrics("m")
    base = (1, 0, 0.1, 2, 0, 0, 0, [])
    metrics.record_stats(
        SchedulerStats(*base, offload_hits=32, offload_saved_blocks=4, offload_bytes_saved=400)
    )
    later = {"offload_saved_blocks": 6, "offload_loaded_blocks": 4, "offload_bytes_saved": 600}
    metrics.record_stats(
        SchedulerStats(*base, offload_hits=64, offload_bytes_loaded=400, offload_seconds=0.5, **later)
    )
    assert value(metrics, "kv_offload_hits_total") == 64
    assert value(metrics, "kv_offload_blocks_total", direction="save") == 6
    assert value(metrics, "kv_offload_blocks_total", direction="load") == 4
    assert value(metrics, "kv_offload_bytes_total", direction="save") == 600
    assert value(metrics, "kv_offload_bytes_total", direction="load") == 400
    assert value(metrics, "kv_offload_host_seconds_total") == 0.5
    disk = {"offload_disk_hits": 48, "offload_spilled_blocks": 5, "offload_disk_read_blocks": 3}
    metrics.record_stats(
        SchedulerStats(
            *base, offload_hits=64, offload_bytes_loaded=400, offload_seconds=0.5, **later, **disk,
            offload_bytes_spilled=500, offload_bytes_disk_read=300,
        )
    )  # fmt: skip
    assert value(metrics, "kv_offload_disk_hits_total") == 48
    assert value(metrics, "kv_offload_blocks_total", direction="spill") == 5
    assert value(metrics, "kv_offload_blocks_total", direction="disk_read") == 3
    assert value(metrics, "kv_offload_bytes_total", direction="spill") == 500
    assert value(metrics, "kv_offload_bytes_total", direction="disk_read") == 300
    assert value(metrics, "kv_offload_blocks_total", direction="save") == 6  # unchanged
    metrics.record_cache_config(16, 1234, True)
    info = {"block_size": "16", "num_gpu_blocks": "1234", "enable_prefix_caching": "true"}
    assert value(metrics, "cache_config_info", **info) == 1
