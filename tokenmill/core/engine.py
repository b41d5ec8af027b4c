"""EngineCore: the loop schedule -> execute -> update, around a queue of steps in flight. The executor
is injected (anything with `execute(SchedulerOutput)` returning an output whose `result()` is a
ModelRunnerOutput), so the core itself never touches a tensor.

With async scheduling the queue holds two steps: step N+1 is scheduled and launched while step N runs
on the device, and only then does the core wait for step N's tokens. Without it the queue holds one
step and the loop is synchronous; so does a step that speculates, since the next step verifies the
drafts proposed from its tokens. A step that samples under grammars launches its forward pass, then
takes in step N's tokens (which advance the grammars), then fills its masks while the forward pass
runs, and only then samples. The offline `LLM` and the server's core process run this same loop.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, cast

import numpy as np

from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerOutput


class PendingOutput(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class AwaitingGrammar(Protocol):
    """A launched step that samples under grammars once given their masks."""

    def with_grammar(self, grammar_bitmask: np.ndarray) -> PendingOutput: ...


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> PendingOutput | AwaitingGrammar: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling
        self.max_steps_in_flight = 2 if async_scheduling else 1
        self.batch_queue: deque[tuple[SchedulerOutput, PendingOutput]] = deque()
        self.num_steps = 0
        self.last_finished: SchedulerOutput | None = None  # the step whose outputs step() returned last

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def _in_flight(self) -> int:
        """Steps the queue may hold: one while the scheduler speculates (the next step's drafts come
        from this one's tokens), else two with async scheduling."""
        return 1 if self.scheduler.spec_active else self.max_steps_in_flight

    def step(self) -> list[EngineCoreOutput]:
        """Launch a step if there is room and work, then (when the queue is full or nothing new could be
        launched) wait for the oldest step in flight and return its outputs."""
        outputs = self._step()
        pending = self.scheduler.take_pending_outputs()
        return pending + outputs if pending else outputs

    def _step(self) -> list[EngineCoreOutput]:
        if len(self.batch_queue) < self._in_flight() and self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            if not scheduler_output.is_empty:
                self.num_steps += 1
                launched = self.executor.execute(scheduler_output)
                if scheduler_output.grammar_req_ids:
                    # The masks need the tokens of the step in flight before this one: take them in
                    # first. Both happen while the device runs this step's forward pass.
                    finished = bool(self.batch_queue)
                    outputs = self._finish_oldest() if finished else []
                    masks = self.scheduler.grammar_bitmask(scheduler_output)
                    pending = cast(AwaitingGrammar, launched).with_grammar(masks)
                    self.batch_queue.append((scheduler_output, pending))
                    if finished or len(self.batch_queue) < self._in_flight():
                        return outputs
                else:
                    self.batch_queue.append((scheduler_output, cast(PendingOutput, launched)))
                    if len(self.batch_queue) < self._in_flight():
                        return []
        return self._finish_oldest() if self.batch_queue else []

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and take in its tokens."""
        scheduler_output, pending = self.batch_queue.popleft()
        self.last_finished = scheduler_output
        return self.scheduler.update_from_output(scheduler_output, pending.result())
