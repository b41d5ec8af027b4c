"""This process's garbage-collection pauses, timed through `gc.callbacks`.

While a process between the engine and a client (the engine core, an API process, a benchmark client)
collects, nothing else in it runs: every stream it carries sees the pause as an inter-token gap. The
server logs long pauses with the process's name, and `bench serve` reports its own, so a gap in a
benchmark can be traced to the process that made it."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger("tokenmill.gc")

# Pauses kept for the report (the longest ones, with when they happened), at most this many.
_MAX_KEPT = 256
# The server's processes log a pause at least this long (a stream at 100 tokens/s misses five tokens).
SERVER_LOG_OVER_S = 0.05


def freeze_startup() -> None:
    """Collect, then move every object alive to the collector's permanent generation, which it never
    walks again: for a process whose model and engine, built at start-up, live as long as it does (the
    engine core, an API process), or as long as an offline LLM, which thaws them when it is dropped
    (frozen objects in reference cycles are never collected: each LLM built and dropped in one process
    kept its model, some 0.5 GB for the embedded one, until exit). Unfrozen, each full collection walked
    them: 4 ms of a 256-request step's host time on a CPU."""
    gc.collect()
    gc.freeze()


class GCPauses:
    def __init__(self, name: str, log_over_s: float | None = None, keep_over_s: float = 0.01) -> None:
        """name: the process, in log lines. log_over_s: pauses at least this long are logged as warnings
        (None: never). keep_over_s: pauses at least this long are kept, with their start on the wall
        clock, for `summary()`."""
        self.name = name
        self.log_over_s = log_over_s
        self.keep_over_s = keep_over_s
        self.collections = [0, 0, 0]  # by generation
        self.seconds = 0.0
        self.max_s = 0.0
        self.kept: list[tuple[float, int, float]] = []  # (wall-clock start, generation, seconds)
        self._started: float | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:  # installed in the middle of a collection
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds += seconds
        self.max_s = max(self.max_s, seconds)
        started = time.time() - seconds
        if self.log_over_s is not None and seconds >= self.log_over_s:
            logger.warning(
                "%s paused %.0f ms for a generation-%d garbage collection (%d objects collected; "
                "from %.3f on the wall clock)",
                self.name, seconds * 1e3, generation, info["collected"], started,
            )  # fmt: skip
        if seconds >= self.keep_over_s:
            if len(self.kept) >= _MAX_KEPT:  # keep the longest
                shortest = min(range(len(self.kept)), key=lambda i: self.kept[i][2])
                if self.kept[shortest][2] >= seconds:
                    return
                del self.kept[shortest]
            self.kept.append((started, generation, seconds))

    def install(self) -> GCPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def summary(self) -> dict[str, Any]:
        """Collections by generation, total and longest pause, and the kept pauses (wall-clock start,
        generation, milliseconds) in time order."""
        return {
            "process": self.name,
            "collections": list(self.collections),
            "total_ms": round(self.seconds * 1e3, 3),
            "max_ms": round(self.max_s * 1e3, 3),
            "pauses_over_ms": {
                str(ms): sum(s >= ms / 1e3 for _, _, s in self.kept)
                for ms in (10, 50, 100)
                if ms / 1e3 >= self.keep_over_s
            },
            "kept": [(round(t, 4), g, round(s * 1e3, 3)) for t, g, s in sorted(self.kept)],
        }
