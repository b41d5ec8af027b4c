"""EngineCore: the loop schedule -> execute -> update, around a queue of steps in flight. The executor
is injected (anything with `prepare(SchedulerOutput)`, the step's host half, and `launch(prepared)`
returning an output whose `result()` is a ModelRunnerOutput), so the core itself never touches a
tensor.

With async scheduling the queue holds two steps: step N+1 is scheduled and launched while step N runs on
the device, and only then does the core wait for step N's tokens. Without it the queue holds one step
and the loop is synchronous; so does a step that speculates, since the next step verifies the drafts
proposed from its tokens: that next step is launched as soon as they are in, before step() returns, so
the caller's work on the outputs overlaps the device. A step that samples under grammars launches its
forward pass, then takes in step N's tokens, then has its masks filled on a helper thread (llguidance's
threads, without the GIL: first step N's tokens into the grammars, then the masks) while the loop
returns step N's outputs and schedules the next step and prepares its inputs (the host half); a grammar
that step N's token completed ends its request when the next step's tokens come in, that token dropped.
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

    def launch(self) -> PendingOutput:
        if self.pending is None:
            self.pending = self.awaiting.with_grammar(self.masks.result())
        return self.pending

    def result(self) -> ModelRunnerOutput:
        return self.launch().result()


class _DeviceWaitsForMasks:
    """A grammar step whose masked sampling is queued behind a wait on the device while the helper fills
    its masks (AwaitingGrammar.host_masks): result() waits for the fill (which touches the matchers),
    then for the tokens."""

    def __init__(self, pending: PendingOutput, filled: Future, masks: HostMasks) -> None:
        self.pending, self.filled, self.masks = pending, filled, masks

    def result(self) -> ModelRunnerOutput:
        self.filled.result()
        output = self.pending.result()
        self.masks.check()
        return output


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
            # The masks need the tokens of the step in flight before this one: take them in first,
            # while the device runs this step's forward pass; then fill on the side.
            awaiting = cast(AwaitingGrammar, launched)
            finished = bool(self.batch_queue)
            outputs = self._finish_oldest() if finished else []
            structured = self.scheduler.structured
            masks = awaiting.host_masks(structured.words) if structured is not None else None
            if masks is not None:
                # The fill first: once the wait is queued, a call that blocks on the device (an allocation)
                # returns only when the helper has published the masks.
                filled = self._fill(scheduler_output, masks)
                pending = awaiting.with_grammar(masks)
                self.batch_queue.append((scheduler_output, _DeviceWaitsForMasks(pending, filled, masks)))
            else:
                self._filling = _FillingMasks(awaiting, self._fill(scheduler_output))
                self.batch_queue.append((scheduler_output, self._filling))
            return outputs if finished or len(self.batch_queue) < self._in_flight() else None
        self.batch_queue.append((scheduler_output, cast(PendingOutput, launched)))
        return [] if len(self.batch_queue) < self._in_flight() else None

    def _fill(self, scheduler_output: SchedulerOutput, masks: HostMasks | None = None) -> Future:
        """The step's masks, filled on the helper thread from matchers nothing else touches until the
        step's tokens are taken in (which waits for them); into `masks`, published when done (or when the
        fill fails), if given."""
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-masks")
            # The helper needs the GIL to hand its result back; the loop's Python would keep it for up
            # to the 5 ms default switch interval (measured on the H200: 0.55x -> 0.58x of unconstrained).
            sys.setswitchinterval(min(sys.getswitchinterval(), 0.0005))
        # the fill's Python half runs here (the device does not wait for `masks` yet)
        fill = self.scheduler.grammar_fill(scheduler_output, None if masks is None else masks.array)
        started = threading.Event()

        def run() -> np.ndarray:
            started.set()
            try:
                return fill()  # llguidance lets the GIL go
            finally:
                if masks is not None:
                    masks.publish()

        future = self._mask_thread.submit(run)
        # Wait (without the GIL) until the helper is in: left to the switch interval, its start took
        # ~0.5 ms on the H200 host while the loop's Python ran on.
        started.wait()
        return future

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
        return self.scheduler.update_from_output(scheduler_output, output)
