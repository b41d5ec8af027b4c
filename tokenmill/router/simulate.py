"""`tokenmill router simulate`: a fleet of simulated replicas (fleet.py) fed one trace (trace.py) and
routed by each policy in turn, with the router's own code (policy.py, index.py): the hit rate, load
balance and latency each policy would give at a scale no single machine runs."""

from __future__ import annotations

import argparse
import heapq
import json
import math
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from tokenmill.plan.catalogue import MODELS, resolve_model
from tokenmill.plan.gpus import GPUS, ceilings_for, resolve_gpu
from tokenmill.plan.memory import Deployment, smallest_fitting_plan
from tokenmill.router.fleet import Replica, Request, StepModel
from tokenmill.router.index import PrefixIndex
from tokenmill.router.policy import POLICIES, make_policy
from tokenmill.router.simulate_report import format_results, plot_results, results_json
from tokenmill.router.trace import Session, read_trace, synthetic_trace

MAX_GPUS_PER_REPLICA = 8  # a replica runs at the smallest tensor-parallel degree that fits, up to this


class FleetConfig(NamedTuple):
    num_replicas: int
    capacity_blocks: int  # each replica's KV pool
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    step_model: StepModel
    balance_threshold: float
    seed: int


class PolicyResult(NamedTuple):
    policy: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the chosen replica's prefix cache held
    estimated_cached_tokens: int  # what the router's index said it held
    prefill_tokens: int  # prompt tokens computed
    output_tokens: int
    duration_s: float  # from the first arrival to the last answer
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    busy_max_over_mean: float  # per-replica step time summed: the busiest over the mean
    requests_max_over_mean: float
    load_cv: float  # coefficient of variation of requests in hand across replicas, mean over arrivals
    wall_s: float  # how long the simulation itself took

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def estimated_hit_rate(self) -> float:
        return self.estimated_cached_tokens / self.prompt_tokens

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s


def simulate(sessions: list[Session], policy_name: str, config: FleetConfig) -> PolicyResult:
    """Replay the trace through the fleet under one policy. Arrivals and replica steps are events in one
    queue; each later turn of a session arrives its think time after the answer before it."""
    started = time.perf_counter()
    largest = max(-(-(r.prompt_len + r.output_len) // config.block_size) for s in sessions for r in s.turns)
    if largest > config.capacity_blocks:
        raise ValueError(
            f"a request of {largest} blocks does not fit a replica's KV pool of {config.capacity_blocks} "
            "blocks: shorten the trace's requests or raise --kv-blocks"
        )
    replicas = {
        f"replica-{i:03d}": Replica(
            f"replica-{i:03d}",
            config.capacity_blocks,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.step_model,
        )
        for i in range(config.num_replicas)
    }
    names = list(replicas)
    index = PrefixIndex(config.capacity_blocks)
    policy = make_policy(policy_name, config.balance_threshold, config.seed)
    # (time, tie-breaker, session and turn for an arrival or None, replica name and version for a step)
    events: list[tuple[float, int, tuple[Session, int] | None, str, int]] = [
        (session.start_s, i, (session, 0), "", 0) for i, session in enumerate(sessions)
    ]
    heapq.heapify(events)
    tie = len(events)
    done: list[Request] = []
    load_cv_sum = 0.0
    num_arrivals = 0
    while events:
        now, _, arrival, name, version = heapq.heappop(events)
        if arrival is not None:
            session, turn = arrival
            request = Request(num_arrivals, session, turn, now)
            hashes = request.trace.prompt_hashes(config.block_size)
            loads = {replica_name: replicas[replica_name].load for replica_name in names}
            mean = sum(loads.values()) / len(loads)
            if mean:
                variance = sum((load - mean) ** 2 for load in loads.values()) / len(loads)
                load_cv_sum += math.sqrt(variance) / mean
            num_arrivals += 1
            matched = _Matched(index, hashes, names)
            name = policy.choose(matched, loads)
            estimated_blocks = index.match(hashes, [name])[name]
            index.record(name, hashes)
            request.replica = name
            request.estimated_cached_tokens = min(
                estimated_blocks * config.block_size, request.trace.prompt_len - 1
            )
            replica = replicas[name]
            replica.waiting.append(request)
            if replica.in_flight is not None:
                step = replica.cut_short(now)
                if step is not None:
                    heapq.heappush(events, (step.start_s + step.duration_s, tie, None, name, replica.version))
                    tie += 1
                continue
        else:
            replica = replicas[name]
            if version != replica.version:
                continue  # the end of a run of decode steps that an arrival cut short
            for request in replica.finish_step(now):
                done.append(request)
                if request.turn + 1 < len(request.session.turns):
                    think_s = request.session.think_s[request.turn]
                    heapq.heappush(events, (now + think_s, tie, (request.session, request.turn + 1), "", 0))
                    tie += 1
        step = replica.plan_step(now)
        if step is not None:
            heapq.heappush(events, (now + step.duration_s, tie, None, replica.name, replica.version))
            tie += 1
    return _result(policy_name, done, list(replicas.values()), load_cv_sum / num_arrivals, started)


class _Matched(Mapping[str, int]):
    """The index's match for the prompt, looked up only when the policy reads it (cache_aware does;
    the others choose by load or in turn, and a 64-replica match per request would be most of the
    simulation's time)."""

    def __init__(self, index: PrefixIndex, hashes: list[int], replicas: list[str]) -> None:
        self._index, self._hashes, self._replicas = index, hashes, replicas
        self._matched: dict[str, int] | None = None

    def _match(self) -> dict[str, int]:
        if self._matched is None:
            self._matched = self._index.match(self._hashes, self._replicas)
        return self._matched

    def __getitem__(self, replica: str) -> int:
        return self._match()[replica]

    def __iter__(self) -> Iterator[str]:
        return iter(self._replicas)

    def __len__(self) -> int:
        return len(self._replicas)


def _result(
    policy: str, done: list[Request], replicas: list[Replica], load_cv: float, started: float
) -> PolicyResult:
    ttfts = sorted(request.first_token_s - request.arrival_s for request in done)
    busy = [replica.busy_s for replica in replicas]
    served = [replica.num_requests for replica in replicas]
    return PolicyResult(
        policy=policy,
        num_requests=len(done),
        prompt_tokens=sum(request.trace.prompt_len for request in done),
        cached_tokens=sum(request.num_cached_tokens for request in done),
        estimated_cached_tokens=sum(request.estimated_cached_tokens for request in done),
        prefill_tokens=sum(replica.num_prefill_tokens for replica in replicas),
        output_tokens=sum(replica.num_output_tokens for replica in replicas),
        duration_s=max(request.finish_s for request in done) - min(request.arrival_s for request in done),
        ttft_p50_s=_percentile(ttfts, 0.5),
        ttft_p99_s=_percentile(ttfts, 0.99),
        ttft_mean_s=sum(ttfts) / len(ttfts),
        busy_max_over_mean=max(busy) * len(busy) / sum(busy),
        requests_max_over_mean=max(served) * len(served) / sum(served),
        load_cv=load_cv,
        wall_s=time.perf_counter() - started,
    )


def _percentile(ordered: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=64, help="replicas in the fleet (default 64)")
    parser.add_argument(
        "--model-shape", default="llama-3.1-8b",
        help=f"the model each replica serves: a planner catalogue name ({', '.join(MODELS)}), a model "
        "directory or a .gguf file (default llama-3.1-8b)",
    )  # fmt: skip
    parser.add_argument("--gpu", default="h200", help=f"each replica's GPU: {', '.join(GPUS)} (default h200)")
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from {', '.join(POLICIES)} (default all)",
    )
    parser.add_argument("--balance-threshold", type=float, default=16, help="cache_aware's load slack")
    parser.add_argument(
        "--trace", type=Path, metavar="JSONL", help="a recorded trace instead of the synthetic one"
    )
    parser.add_argument(
        "--rate", type=float, default=200.0, help="synthetic: requests a second (default 200)"
    )
    parser.add_argument("--conversations", type=int, default=2000, help="synthetic: chats (default 2000)")
    parser.add_argument("--turns", type=int, default=6, help="synthetic: requests per chat (default 6)")
    parser.add_argument("--system-prompt-len", type=int, default=2048, help="synthetic (default 2048)")
    parser.add_argument(
        "--num-system-prompts", type=int, default=8, help="synthetic: shared by all chats (8)"
    )
    parser.add_argument("--user-turn-len", type=int, default=256, help="synthetic: mean tokens (default 256)")
    parser.add_argument("--output-len", type=int, default=256, help="synthetic: mean tokens (default 256)")
    parser.add_argument("--think-time", type=float, default=10.0, help="synthetic: mean seconds (default 10)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="the engine's (default 256)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="the engine's (default 8192)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        help="each replica's KV pool in blocks (default: the planner's for the model and GPU)",
    )
    parser.add_argument(
        "--step-overhead-ms", type=float, default=1.0,
        help="added to each step's roofline floor (default 1.0: a measured 8B decode step on an H200 was "
        "4.72 ms against its 3.60 ms floor)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="for the synthetic trace and the random policy")
    parser.add_argument("--out", type=Path, metavar="JSON", help="write the results here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="plot hit rate and TTFT P99 by policy here")


def simulate_main(args: argparse.Namespace) -> int:
    policies = _policies(args.policies)
    config, deployment, tp = fleet_config(args)
    sessions = trace_from_args(args)
    num_requests = sum(len(session.turns) for session in sessions)
    print(
        f"{config.num_replicas} replicas of {deployment.shape.name} on {tp} x {deployment.gpu.name}, "
        f"{config.capacity_blocks:,} KV blocks of {config.block_size} tokens each; "
        f"{num_requests:,} requests in {len(sessions):,} sessions"
    )
    results = [simulate(sessions, policy, config) for policy in policies]
    print(format_results(results))
    if args.out:
        _write(args.out, json.dumps(results_json(args, config, deployment, tp, results), indent=2) + "\n")
        print(f"results: {args.out}")
    if args.plot:
        if plot_results(args.plot, results):
            print(f"plot: {args.plot}")
        else:
            print("plot skipped: matplotlib is not installed")
    return 0


def fleet_config(args: argparse.Namespace) -> tuple[FleetConfig, Deployment, int]:
    for knob in ("replicas", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_blocks"):
        value = getattr(args, knob)
        if value is not None and value < 1:
            raise ValueError(f"--{knob.replace('_', '-')} must be >= 1, got {value}")
    if args.max_num_batched_tokens < args.max_num_seqs:
        raise ValueError(
            f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must be >= --max-num-seqs "
            f"({args.max_num_seqs}): every running request decodes each step"
        )
    for knob in ("balance_threshold", "step_overhead_ms"):
        if getattr(args, knob) < 0:
            raise ValueError(f"--{knob.replace('_', '-')} must be >= 0, got {getattr(args, knob)}")
    deployment = Deployment(
        resolve_model(args.model_shape),
        resolve_gpu(args.gpu),
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    memory = smallest_fitting_plan(deployment, MAX_GPUS_PER_REPLICA)
    ceilings = ceilings_for(deployment.gpu, deployment.weight_dtype, measured=False)
    config = FleetConfig(
        num_replicas=args.replicas,
        capacity_blocks=args.kv_blocks or memory.kv_capacity_tokens // args.block_size,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        step_model=StepModel(deployment, ceilings, memory.tp, args.step_overhead_ms / 1e3),
        balance_threshold=args.balance_threshold,
        seed=args.seed,
    )
    return config, deployment, memory.tp


def trace_from_args(args: argparse.Namespace) -> list[Session]:
    if args.trace is not None:
        return read_trace(args.trace, args.block_size)
    for knob in ("conversations", "turns", "num_system_prompts", "user_turn_len", "output_len"):
        if getattr(args, knob) < 1:
            raise ValueError(f"--{knob.replace('_', '-')} must be >= 1, got {getattr(args, knob)}")
    if args.system_prompt_len < 0:
        raise ValueError(f"--system-prompt-len must be >= 0, got {args.system_prompt_len}")
    if not args.rate > 0:
        raise ValueError(f"--rate must be > 0 requests a second, got {args.rate}")
    if args.think_time < 0:
        raise ValueError(f"--think-time must be >= 0 seconds, got {args.think_time}")
    return synthetic_trace(
        conversations=args.conversations,
        turns=args.turns,
        rate=args.rate,
        system_prompt_len=args.system_prompt_len,
        num_system_prompts=args.num_system_prompts,
        user_turn_len=args.user_turn_len,
        output_len=args.output_len,
        think_time_s=args.think_time,
        block_size=args.block_size,
        seed=args.seed,
    )


def _policies(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise ValueError(f"--policies takes names from {', '.join(POLICIES)}, got {value!r}")
    return list(dict.fromkeys(names))


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot write it ({exc.strerror or exc})") from exc
