"""`router simulate` end to end on small fleets: what each policy does to the true hit rate, how the
router's estimate relates to it, determinism, the KV pool's bound, the options' errors and outputs."""

from __future__ import annotations

import argparse
import json

import pytest

from tokenmill.router.fleet import Replica
from tokenmill.router.policy import POLICIES
from tokenmill.router.simulate import (
    PolicyResult,
    add_simulate_arguments,
    fleet_config,
    simulate,
    simulate_main,
    trace_from_args,
)

# 8 replicas, 150 chats of 4 turns on 4 shared 512-token system prompts: a prefix-heavy trace that
# simulates in a few hundredths of a second per policy.
SMALL = [
    "--replicas", "8", "--conversations", "150", "--turns", "4", "--system-prompt-len", "512",
    "--num-system-prompts", "4", "--user-turn-len", "64", "--output-len", "32", "--think-time", "1",
    "--rate", "100",
]  # fmt: skip


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    return parser.parse_args([*SMALL, *argv])


def _run(*argv: str, policies: tuple[str, ...] = POLICIES) -> dict[str, PolicyResult]:
    args = _args(*argv)
    config, _, _ = fleet_config(args)
    sessions = trace_from_args(args)
    return {policy: simulate(sessions, policy, config) for policy in policies}


def test_cache_aware_hits_more_than_round_robin_and_random_on_a_prefix_heavy_trace():
    results = _run()
    assert all(result.num_requests == 600 for result in results.values())
    cache_aware = results["cache_aware"]
    # Each chat's turns stay where its history is cached; spread over 8 replicas, a turn finds its
    # history only on the one that served the turn before, one time in eight.
    assert cache_aware.hit_rate > 0.85
    for other in ("round_robin", "random", "least_load"):
        assert cache_aware.hit_rate > results[other].hit_rate + 0.15
        assert cache_aware.prefill_tokens < results[other].prefill_tokens
    # Fewer replicas took the chats' first turns, so cache_aware is the least even.
    assert cache_aware.requests_max_over_mean > results["round_robin"].requests_max_over_mean
    assert results["round_robin"].requests_max_over_mean == 1.0  # 600 requests over 8: 75 each


def test_one_shared_system_prompt_and_no_history_hits_alike_under_every_policy():
    results = _run("--turns", "1", "--num-system-prompts", "1", "--conversations", "400")
    # Each replica computes the one system prompt the first time it gets a request, then every request
    # it serves hits those 512 tokens and nothing more: the rest of each prompt is new text.
    for policy in ("round_robin", "least_load", "random"):
        assert results[policy].cached_tokens == 512 * (400 - 8)
    # cache_aware sends the prompt where it is cached while that replica keeps up, so fewer replicas
    # compute it: a few prompts' worth of difference in 400.
    assert results["cache_aware"].cached_tokens % 512 == 0
    assert results["cache_aware"].cached_tokens >= 512 * (400 - 8)
    rates = [result.hit_rate for result in results.values()]
    assert max(rates) - min(rates) < 0.02


def test_the_routers_estimate_misses_only_the_answers_when_the_pool_holds_everything():
    results = _run()
    for result in results.values():
        # The index records prompts as sent; the replica also caches each answer's full blocks, which
        # the next turn's prompt starts with.
        assert 0 < result.estimated_cached_tokens <= result.cached_tokens
    cache_aware = results["cache_aware"]
    assert cache_aware.estimated_hit_rate > 0.9 * cache_aware.hit_rate
    round_robin = results["round_robin"]
    assert round_robin.estimated_hit_rate == pytest.approx(round_robin.hit_rate, abs=0.02)


def test_the_same_seed_gives_the_same_results_and_another_seed_another_trace():
    first = _run(policies=("cache_aware", "random"))
    again = _run(policies=("cache_aware", "random"))
    for policy in first:
        assert first[policy]._replace(wall_s=0) == again[policy]._replace(wall_s=0)
    other = _run("--seed", "1", policies=("cache_aware",))
    assert other["cache_aware"].prompt_tokens != first["cache_aware"].prompt_tokens


def test_a_replicas_true_cache_never_exceeds_its_kv_pool(monkeypatch):
    peaks: dict[str, int] = {}
    plan_step = Replica.plan_step

    def watched(self: Replica, now: float):
        step = plan_step(self, now)  # admissions are the only place blocks are taken
        peaks[self.name] = max(peaks.get(self.name, 0), self.num_blocks_held)
        return step

    monkeypatch.setattr(Replica, "plan_step", watched)
    small = _run("--kv-blocks", "120", policies=("round_robin",))["round_robin"]
    assert max(peaks.values()) == 120  # full, and evicting
    monkeypatch.setattr(Replica, "plan_step", plan_step)
    ample = _run(policies=("round_robin",))["round_robin"]
    assert small.hit_rate < ample.hit_rate
    assert small.num_requests == ample.num_requests


@pytest.mark.parametrize(
    ("argv", "knob"),
    [
        (["--replicas", "0"], "--replicas"),
        (["--rate", "0"], "--rate"),
        (["--conversations", "0"], "--conversations"),
        (["--turns", "0"], "--turns"),
        (["--system-prompt-len", "-1"], "--system-prompt-len"),
        (["--output-len", "0"], "--output-len"),
        (["--think-time", "-1"], "--think-time"),
        (["--policies", "cache_aware,fastest"], "--policies"),
        (["--policies", ","], "--policies"),
        (["--block-size", "0"], "--block-size"),
        (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"], "--max-num-batched-tokens"),
        (["--balance-threshold", "-1"], "--balance-threshold"),
        (["--step-overhead-ms", "-0.5"], "--step-overhead-ms"),
        (["--kv-blocks", "40"], "--kv-blocks"),  # smaller than the longest request
        (["--model-shape", "llama-9"], "unknown model"),
        (["--gpu", "h300"], "unknown GPU"),
    ],
)
def test_bad_options_raise_a_value_error_naming_the_knob(argv, knob):
    with pytest.raises(ValueError, match=knob):
        simulate_main(_args(*argv))


def test_simulate_main_prints_the_table_and_writes_json_and_a_plot(tmp_path, capsys):
    out, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    assert (
        simulate_main(_args("--policies", "round_robin,cache_aware", "--out", str(out), "--plot", str(plot)))
        == 0
    )
    printed = capsys.readouterr().out
    assert "8 replicas of llama-3.1-8b on 1 x H200" in printed
    assert printed.index("round_robin") < printed.index("cache_aware")  # in the order asked
    written = json.loads(out.read_text())
    assert written["fleet"]["replicas"] == 8
    assert [row["policy"] for row in written["results"]] == ["round_robin", "cache_aware"]
    assert written["results"][1]["hit_rate"] > written["results"][0]["hit_rate"]
    if "plot skipped" not in printed:
        assert plot.read_bytes().startswith(b"\x89PNG")
