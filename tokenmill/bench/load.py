"""The load `bench serve` puts on a server: requests sent on a schedule from one event loop, or spread
over several client processes with one start and one clock, each request's timings kept (client.py),
and the client processes' own garbage-collection pauses."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp

from tokenmill.bench.client import RequestInput, RequestResult, send_request
from tokenmill.bench.prompts import SampleRequest
from tokenmill.bench.tokenizer import BenchTokenizer
from tokenmill.gc_pauses import GCPauses


@dataclass(frozen=True)
class ServeTarget:
    """Where requests go and how each is shaped."""

    api_url: str
    model: str
    chat: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # sampling knobs sent with every request
    request_timeout_s: float = 6 * 3600.0


class LoadRun(NamedTuple):
    results: list[RequestResult]
    duration_s: float
    warmup_errors: list[str]
    start_time: float = 0.0  # perf_counter at the first timed send
    clock_to_wall: float = 0.0  # time.time() - time.perf_counter(): the results' times on the wall clock
    gc_pauses: tuple[dict, ...] = ()  # each client process's garbage-collection pauses while timed


async def run_load(
    target: ServeTarget,
    samples: Sequence[SampleRequest],
    offsets: Sequence[float],
    *,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    tokenizer: BenchTokenizer | None = None,
    show_progress: bool = False,
    start_gate: Callable[[], object] | None = None,
    on_request_done: Callable[[], object] | None = None,
    name: str = "bench client",
) -> LoadRun:
    """Send `samples[i]` at `offsets[i]` seconds after the start, at most `max_concurrency` in flight.

    Warm-up requests (the first samples, cycled) run to completion before the clock starts and are
    not counted. The duration runs from the first timed send to the last response's end.
    `start_gate` (blocking) is called in a thread after the warm-ups and before the clock starts:
    client processes wait there for each other. `on_request_done` is called as each timed request ends.
    The client's own garbage-collection pauses while timed are reported (under `name`): its streams
    see them as inter-token gaps.
    """
    timeout = aiohttp.ClientTimeout(total=target.request_timeout_s)
    # No connection cap: the schedule and --max-concurrency alone decide how many requests are open.
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(sample: SampleRequest) -> RequestResult:
            request = RequestInput(
                api_url=target.api_url,
                model=target.model,
                prompt=sample.prompt,
                prompt_len=sample.prompt_len,
                max_tokens=sample.expected_output_len,
                chat=target.chat,
                ignore_eos=target.ignore_eos,
                messages=sample.messages,
                extra_body=target.extra_body,
            )
            if limiter is None:
                return await send_request(session, request, headers=target.headers, tokenizer=tokenizer)
            async with limiter:
                return await send_request(session, request, headers=target.headers, tokenizer=tokenizer)

        warmups = [samples[i % len(samples)] for i in range(num_warmups)] if samples else []
        warmup_results = await asyncio.gather(*(one(s) for s in warmups))
        if start_gate is not None:
            await asyncio.get_running_loop().run_in_executor(None, start_gate)

        progress = _progress_bar(len(samples), show_progress)
        pauses = GCPauses(name).install()
        start = time.perf_counter()
        clock_to_wall = time.time() - start
        tasks = []
        for sample, offset in zip(samples, offsets, strict=True):
            # Sleep to an absolute send time, so scheduling jitter never accumulates.
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(sample))
            if progress is not None:
                task.add_done_callback(lambda _: progress.update(1))
            if on_request_done is not None:
                task.add_done_callback(lambda _: on_request_done())
            tasks.append(task)
        results = list(await asyncio.gather(*tasks))
        duration_s = time.perf_counter() - start
        pauses.uninstall()
        if progress is not None:
            progress.close()
    warmup_errors = [r.error for r in warmup_results if not r.success]
    return LoadRun(results, duration_s, warmup_errors, start, clock_to_wall, (pauses.summary(),))


def run_load_processes(
    target: ServeTarget,
    samples: Sequence[SampleRequest],
    offsets: Sequence[float],
    *,
    processes: int,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    tokenizer: BenchTokenizer | None = None,
    show_progress: bool = False,
) -> LoadRun:
    """`run_load` spread over `processes` client processes, for loads one event loop cannot time.

    At hundreds of streams a single client process spends most of a core parsing events, and its own
    scheduling delays show up as inter-token latency. Request i goes to process i % processes with its
    own send time; --max-concurrency and the warm-ups are divided between the processes (so the cap
    holds per share, not globally). All processes finish their warm-ups before any starts the clock.
    Results come back in the order of `samples`; times are on one clock, as `time.perf_counter` is the
    system-wide monotonic clock on Linux (and macOS).
    """
    if processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {processes}")
    if max_concurrency is not None:
        processes = min(processes, max_concurrency)
    processes = max(1, min(processes, len(samples)))
    context = multiprocessing.get_context("spawn")
    start_gate = context.Barrier(processes)
    finished = context.Value("i", 0)
    results_queue = context.Queue()
    workers = []
    for rank in range(processes):
        indices = list(range(rank, len(samples), processes))
        share = dict(
            samples=[samples[i] for i in indices],
            offsets=[offsets[i] for i in indices],
            max_concurrency=_share(max_concurrency, rank, processes),
            num_warmups=_share(num_warmups, rank, processes),
        )
        worker = context.Process(
            target=_client_process,
            args=(rank, target, share, tokenizer, start_gate, finished, results_queue),
            daemon=True,
        )
        worker.start()
        workers.append(worker)

    progress = _progress_bar(len(samples), show_progress)
    outcomes: dict[int, Any] = {}
    while len(outcomes) < processes:
        try:
            rank, outcome = results_queue.get(timeout=0.5)
            outcomes[rank] = outcome
        except queue.Empty:  # check that no client died without answering
            dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if dead and results_queue.empty():
                raise RuntimeError(f"a bench client process died (exit code {dead[0]})") from None
        if progress is not None:
            progress.update(finished.value - progress.n)
    if progress is not None:
        progress.close()
    for worker in workers:
        worker.join()
    failures = [outcome for outcome in outcomes.values() if isinstance(outcome, str)]
    if failures:
        raise RuntimeError(f"a bench client process failed: {failures[0]}")

    results: list[RequestResult] = [RequestResult() for _ in samples]
    warmup_errors: list[str] = []
    for rank, run in outcomes.items():
        for position, result in enumerate(run.results):
            results[rank + position * processes] = result
        warmup_errors += run.warmup_errors
    start = min(run.start_time for run in outcomes.values())
    end = max(run.start_time + run.duration_s for run in outcomes.values())
    runs = [outcomes[rank] for rank in sorted(outcomes)]
    pauses = tuple(pause for run in runs for pause in run.gc_pauses)
    return LoadRun(results, end - start, warmup_errors, start, runs[0].clock_to_wall, pauses)


def _share(total: int | None, rank: int, processes: int) -> int | None:
    """Process `rank`'s part of `total` when it is divided as evenly as integers allow."""
    if total is None:
        return None
    return total // processes + (rank < total % processes)


def _client_process(
    rank: int,
    target: ServeTarget,
    share: dict[str, Any],
    tokenizer: BenchTokenizer | None,
    start_gate: Any,
    finished: Any,
    results_queue: Any,
) -> None:
    def count_one() -> None:
        with finished.get_lock():
            finished.value += 1

    try:
        run = asyncio.run(
            run_load(
                target,
                share["samples"],
                share["offsets"],
                max_concurrency=share["max_concurrency"],
                num_warmups=share["num_warmups"],
                tokenizer=tokenizer,
                start_gate=start_gate.wait,
                on_request_done=count_one,
                name=f"bench client {rank}",
            )
        )
    except BaseException as exc:  # reported to the parent, which raises it there
        start_gate.abort()
        results_queue.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    results_queue.put((rank, run))


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr)
