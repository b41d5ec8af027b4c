"""EngineCore: the loop schedule -> execute -> update. The model runner is injected (anything with
`execute(SchedulerOutput)` returning an output whose `result()` is a ModelRunnerOutput), so the core
itself never touches a tensor. A step can be split into launch and finish, so the caller can do host
work (detokenizing the previous step) while the device runs."""

from __future__ import annotations

from typing import Protocol

from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerOutput


class PendingOutput(Protocol):
    def result(self) -> ModelRunnerOutput: ...


class Executor(Protocol):
    def execute(self, scheduler_output: SchedulerOutput) -> PendingOutput: ...


LaunchedStep = tuple[SchedulerOutput, PendingOutput]


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        launched = self.launch_step()
        return self.finish_step(launched) if launched is not None else []

    def launch_step(self) -> LaunchedStep | None:
        """Schedule and start executing one step; None when there is nothing to run."""
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return None
        self.num_steps += 1
        return scheduler_output, self.executor.execute(scheduler_output)

    def finish_step(self, launched: LaunchedStep) -> list[EngineCoreOutput]:
        scheduler_output, pending = launched
        return self.scheduler.update_from_output(scheduler_output, pending.result())
