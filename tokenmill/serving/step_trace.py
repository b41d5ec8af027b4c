"""Per-step traces for finding where inter-token gaps come from under load, turned on with
TOKENMILL_STEP_TRACE=FILE: the engine core writes FILE (one row per step that returned outputs), each
API process FILE.api<N> (one row per step's outputs it received). Rows are kept in memory and written
as JSON when the process stops."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("tokenmill")

ENV = "TOKENMILL_STEP_TRACE"


class StepTrace:
    def __init__(self, path: str, columns: tuple[str, ...]) -> None:
        self.path = path
        self.columns = columns
        self.rows: list[tuple] = []

    @classmethod
    def from_env(cls, columns: tuple[str, ...], suffix: str = "") -> StepTrace | None:
        path = os.environ.get(ENV)
        return cls(path + suffix, columns) if path else None

    def add(self, *values: float | int) -> None:
        self.rows.append(values)

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"columns": self.columns, "rows": self.rows}, f)
        logger.info("wrote the step trace (%d rows) to %s", len(self.rows), self.path)
