"""The step log a workload writes: one JSON line per event (a launch, a step), appended as it happens.

Tests and the bench read a job's figures from the job's own account: when each step finished, where
a launch resumed from, how a rank got its state. Lines are written whole and line buffered, so a
SIGKILL loses no finished line; each carries `t`, the wall time it was written (unless given).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any


class StepLog:
    """An append-only JSON-lines file; `per_process` names it `steps.<pid>.jsonl` in a directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)  # line buffered: a SIGKILL loses no finished line

    @classmethod
    def per_process(cls, directory: str | os.PathLike[str]) -> StepLog:
        """The log of this process in `directory` (each rank, and each replacement, has its own)."""
        return cls(Path(directory) / f"steps.{os.getpid()}.jsonl")

    def write(self, **fields: Any) -> None:
        """One line: `fields`, with `t` first (now, unless given)."""
        self._file.write(json.dumps({"t": time.time(), **fields}) + "\n")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
