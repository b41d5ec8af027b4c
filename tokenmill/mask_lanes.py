"""Mask lanes: a step's grammar masks filled by threads that each keep the same matchers (families)
step after step, each with an llguidance pool of one worker of its own, where llguidance's shared pool
deals them out to whichever worker steals them (structured_outputs.MASK_LANES)."""

from __future__ import annotations

import os
import threading
from typing import Any


class MaskLanes:
    """A step's masks over `threads` lanes: lane i a thread with an llguidance pool of one worker of its
    own, filling the rows dealt to it. With pin each worker keeps a CPU of its own (not the first of the
    process's when there are more CPUs than lanes): a pool spawns its worker from the thread that builds
    it, on that thread's CPUs."""

    def __init__(self, threads: int, pin: bool = False) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > threads:
            cpus = cpus[1:]
        self.threads, self.pin, self.cpus = threads, pin, cpus
        self._go = [threading.Event() for _ in range(threads)]
        self._done = [threading.Event() for _ in range(threads)]
        self._jobs: list[tuple] = [()] * threads
        self._errors: list[BaseException | None] = [None] * threads
        ready = threading.Barrier(threads + 1)
        for lane in range(threads):
            threading.Thread(
                target=self._run, args=(lane, ready), daemon=True, name=f"tokenmill-mask-lane-{lane}"
            ).start()
        ready.wait()

    def _run(self, lane: int, ready: threading.Barrier) -> None:
        import llguidance

        if self.pin:
            os.sched_setaffinity(0, {self.cpus[lane % len(self.cpus)]})
        executor = llguidance.LLExecutor(1)
        ready.wait()
        while True:
            self._go[lane].wait()
            self._go[lane].clear()
            try:
                executor.unsafe_compute_mask_ptr(*self._jobs[lane])
            except BaseException as exc:  # handed to fill(), which raises it on the caller's thread
                self._errors[lane] = exc
            self._done[lane].set()

    def fill(self, lanes: list[list[tuple[Any, int]]], pointer: int, row_bytes: int, rows: int) -> None:
        """Each lane's (matcher, row) pairs into the [rows, row_bytes] mask at `pointer`; returns when
        every lane is done (each lets the GIL go while it fills)."""
        busy = [lane for lane, work in enumerate(lanes) if work]
        for lane in busy:
            self._jobs[lane] = (lanes[lane], pointer, row_bytes, rows)
            self._go[lane].set()
        errors = []
        for lane in busy:
            self._done[lane].wait()
            self._done[lane].clear()
            if self._errors[lane] is not None:
                errors.append(self._errors[lane])
                self._errors[lane] = None
        if errors:
            raise errors[0]
