"""EngineCore: the loop schedule -> execute -> update, around a queue of steps in flight. The executor
is injected (anything with `prepare(SchedulerOutput)`, the step's host half, and `launch(prepared)`
returning an output whose `result()` is a ModelRunnerOutput), so the core itself never touches a
tensor.

With async scheduling the queue holds two steps: step N+1 is scheduled and launched while step N runs on
the device, and only then does the core wait for step N's tokens. Without it the queue holds one step
and the loop is synchronous; so does a step that speculates, since the next step verifies the drafts
proposed from its tokens: that next step is launched as soon as they are in, before step() returns, so
the caller's work on the outputs overlaps the device. A step that samples under grammars launches its
forward pass, then has its masks filled on a helper thread (llguidance's threads, without the GIL:
first step N's tokens into the grammars, taken straight from step N's output as soon as they reach the
host, then the masks); once the tokens are in the grammars the loop takes step N in, returns its
outputs and schedules the next step and prepares its inputs (the host half) while the masks fill; a
grammar that step N's token completed ends its request when the next step's tokens come in, that token
dropped.
On a GPU the masks go to pinned memory and the masked sampling is queued as soon as the fill has begun,
its masking kernel waiting on the device for a counter the helper sets once they are in
(AwaitingGrammar.host_masks): the loop never waits for the masks, and the next step launches behind
that sampling. Elsewhere the sampling is queued just before
the next step launches (or when its own tokens are wanted), so the fill overlaps the forward pass and
the host's own work. The offline `LLM` and the server's core process run this same loop.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, cast

import numpy as np

from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerOutput


class PendingOutput(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class HostMasks(Protocol):
    """Masks the device waits for: fill `array`, then publish() once; check() after the step's tokens
    (worker/step_output.py)."""

    array: np.ndarray

    def publish(self) -> None: ...

    def check(self) -> None: ...


class AwaitingGrammar(Protocol):
    """A launched step that samples under grammars once given their masks: an array, or the HostMasks
    from host_masks(words) (None where the device cannot wait for the host), filled after."""

    def with_grammar(self, grammar_bitmask: np.ndarray | HostMasks) -> PendingOutput: ...

    def host_masks(self, words: int) -> HostMasks | None: ...


class Executor(Protocol):
    def prepare(self, scheduler_output: SchedulerOutput) -> object: ...

    def launch(self, prepared: object) -> PendingOutput | AwaitingGrammar: ...


class _FillingMasks:
    """A launched step under grammars whose masks are being filled: launch() waits for them and queues
    its sampling (before the next step's launch, which reads the sampled tokens on the device);
    result() launches first if nothing else did."""

    def __init__(self, awaiting: AwaitingGrammar, masks: Future) -> None:
        self.awaiting, self.masks = awaiting, masks
        self.pending: PendingOutput | None = None
        self.grammar_stopped: dict[str, str | None] = {}

    def launch(self) -> PendingOutput:
        if self.pending is None:
            mask, self.grammar_stopped = self.masks.result()
            self.pending = self.awaiting.with_grammar(mask)
        return self.pending

    def result(self) -> ModelRunnerOutput:
        return self.launch().result()


class _DeviceWaitsForMasks:
    """A grammar step whose masked sampling is queued behind a wait on the device while the helper fills
    its masks (AwaitingGrammar.host_masks): result() waits for the fill (which touches the matchers),
    then for the tokens."""

    def __init__(self, pending: PendingOutput, filled: Future, masks: HostMasks) -> None:
        self.pending, self.filled, self.masks = pending, filled, masks
        self.grammar_stopped: dict[str, str | None] = {}

    def result(self) -> ModelRunnerOutput:
        _, self.grammar_stopped = self.filled.result()
        output = self.pending.result()
        self.masks.check()
        return output


def _tokens_in_flight(step: PendingOutput) -> tuple | None:
    """A step in flight's rows and a call for its tokens (PendingRunnerOutput.tokens_in_flight), where its
    executor offers them; None elsewhere."""
    inner = getattr(step, "pending", step)  # a grammar step: its queued sampling
    offer = getattr(inner, "tokens_in_flight", None)
    return offer() if offer is not None else None


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.max_steps_in_flight = 2 if async_scheduling else 1
        self.batch_queue: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        self.num_steps = 0
        self.last_finished: SchedulerOutput | None = None  # the step whose outputs step() returned last
        self._filling: _FillingMasks | None = None  # the last grammar step, until its sampling is queued
        self._mask_thread: ThreadPoolExecutor | None = None
        # Host seconds the loop spent blocked: on a grammar step's masks (then queueing its sampling), and
        # on the oldest step's tokens (then reading them back). Benchmarks report them per step.
        self.seconds_on_masks = 0.0
        self.seconds_on_tokens = 0.0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def _in_flight(self) -> int:
        """Steps the queue may hold: one while the scheduler speculates (the next step's drafts come
        from this one's tokens), else two with async scheduling."""
        return 1 if self.scheduler.spec.active else self.max_steps_in_flight

    def step(self) -> list[EngineCoreOutput]:
        """Launch a step if there is room and work, then (when the queue is full or nothing new could be
        launched) wait for the oldest step in flight and return its outputs."""
        outputs = self._step()
        pending = self.scheduler.take_pending_outputs()
        return pending + outputs if pending else outputs

    def _step(self) -> list[EngineCoreOutput]:
        if len(self.batch_queue) < self._in_flight() and self.scheduler.has_unfinished_requests():
            outputs = self._launch_next()
            if outputs is not None:
                return outputs
        if not self.batch_queue:
            return []
        outputs = self._finish_oldest()
        if self.scheduler.spec.active and not self.batch_queue and self.scheduler.has_unfinished_requests():
            # Launch ahead: the step just taken in speculated, so the next one's drafts are in. Launching
            # it now, before the caller turns these outputs into text (or sends them), keeps that work
            # off the gap between the device's steps, which a speculating loop cannot otherwise hide.
            outputs = (self._launch_next() or []) + outputs
        return outputs

    def _launch_next(self) -> list[EngineCoreOutput] | None:
        """Schedule and launch a step. Returns the outputs to hand back now, or None when the caller should
        go on to wait for the oldest step (the queue is full)."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return None
        self.num_steps += 1
        prepared = self.executor.prepare(scheduler_output)
        self._launch_filled()
        launched = self.executor.launch(prepared)
        if scheduler_output.grammar_req_ids:
            # The masks need the tokens of the step in flight before this one: the helper takes them
            # straight from that step's output as soon as they are on the host, and fills on the side,
            # while the device runs this step's forward pass and the loop takes the same tokens in.
            awaiting = cast(AwaitingGrammar, launched)
            in_flight = _tokens_in_flight(self.batch_queue[-1][1]) if self.batch_queue else None
            structured = self.scheduler.structured
            masks = awaiting.host_masks(structured.words) if structured is not None else None
            if masks is not None:
                # The fill first: once the wait is queued, a call that blocks on the device (an allocation)
                # returns only when the helper has published the masks.
                filled, consumed = self._fill(scheduler_output, masks, in_flight)
                pending = awaiting.with_grammar(masks)
                step: PendingOutput = _DeviceWaitsForMasks(pending, filled, masks)
            else:
                filled, consumed = self._fill(scheduler_output, None, in_flight)
                step = self._filling = _FillingMasks(awaiting, filled)
            if in_flight is not None:
                # Until the helper has handed the tokens to the grammars (a GIL taken between its calls
                # into llguidance waits for the loop's Python up to a switch interval), then take them in.
                consumed.wait()
            finished = bool(self.batch_queue)
            outputs = self._finish_oldest() if finished else []
            self.batch_queue.append((scheduler_output, step))
            return outputs if finished or len(self.batch_queue) < self._in_flight() else None
        self.batch_queue.append((scheduler_output, cast(PendingOutput, launched)))
        return [] if len(self.batch_queue) < self._in_flight() else None

    def _fill(
        self,
        scheduler_output: SchedulerOutput,
        masks: HostMasks | None = None,
        in_flight: tuple | None = None,
    ) -> tuple[Future, threading.Event]:
        """The step's masks, filled on the helper thread from matchers nothing else touches until the
        step's tokens are taken in (which waits for them); into `masks`, published when done (or when the
        fill fails), if given. in_flight: the step before, whose tokens the helper takes from its output
        (Scheduler.grammar_fill). The future gives (masks, the requests whose grammar is stopped); the
        event is set once the grammars have their tokens (or the fill failed)."""
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-masks")
            # The helper takes the GIL between its calls into llguidance and to publish the masks; the
            # loop's Python would keep it for up to the 5 ms default switch interval (H200: 0.55x -> 0.58x
            # of unconstrained at 0.5 ms), and at 0.1 ms the device waited 0.36-0.38 ms a step in the
            # masking kernel against 0.48-0.55 (docs/performance.md, seventeenth session).
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0001))
        # the fill's Python half runs here (the device does not wait for `masks` yet)
        into = None if masks is None else masks.array
        fill = self.scheduler.grammar_fill(scheduler_output, into, in_flight)
        started, consumed = threading.Event(), threading.Event()
        published: list[bool] = []

        def publish() -> None:
            if masks is not None and not published:
                published.append(True)
                masks.publish()

        def run() -> tuple[np.ndarray, dict[str, str | None]]:
            started.set()
            try:
                return fill(publish, consumed.set)  # llguidance lets the GIL go
            finally:
                consumed.set()
                publish()

        future = self._mask_thread.submit(run)
        # Wait (without the GIL) until the helper is in: left to the switch interval, its start took
        # ~0.5 ms on the H200 host while the loop's Python ran on.
        started.wait()
        return future, consumed

    def _launch_filled(self) -> None:
        """Queue the last grammar step's sampling (waiting for its masks) before anything else launches."""
        if self._filling is not None:
            start = time.perf_counter()
            self._filling.launch()
            self.seconds_on_masks += time.perf_counter() - start
            self._filling = None

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and take in its tokens."""
        scheduler_output, pending = self.batch_queue.popleft()
        self.last_finished = scheduler_output
        start = time.perf_counter()
        output = pending.result()
        self.seconds_on_tokens += time.perf_counter() - start
        stopped: dict[str, str | None] = getattr(pending, "grammar_stopped", {})
        return self.scheduler.update_from_output(scheduler_output, output, stopped)
