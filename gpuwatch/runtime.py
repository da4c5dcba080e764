"""The runtime directory, the contract with trainers: status.json out, trainers/<pid>.json in.

Every write is temp file + rename, so a trainer never reads half a file. trainers/ is
sticky and world-writable (like /tmp) because ranks run as their own users.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from gpuwatch.model import Snapshot, TrainerInfo

log = logging.getLogger("gpuwatch.runtime")

_TRAINER_FIELDS = {f.name for f in fields(TrainerInfo)}


def write_json_atomic(path: Path, body: Any) -> None:
    """Write JSON to `path` through a temp file in the same directory and an atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(body, out, separators=(",", ":"))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def status_body(snapshot: Snapshot) -> dict[str, Any]:
    """status.json: per GPU its uuid, state, quarantined flag, epoch and findings."""
    return {
        "t": snapshot.t,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "state": g.state.value,
                "quarantined": g.quarantined,
                "epoch": g.epoch,
                "findings": [f.as_dict() for f in g.findings],
            }
            for g in snapshot.gpus
        ],
    }


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RuntimeDir:
    """`/run/gpuwatch` (configurable): status.json and the trainers' reports."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.trainers = self.path / "trainers"

    def prepare(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.trainers.mkdir(exist_ok=True)
        os.chmod(self.trainers, 0o1777)

    def write_status(self, snapshot: Snapshot) -> None:
        write_json_atomic(self.path / "status.json", status_body(snapshot))

    def read_trainers(
        self, now: float, stale_after_s: float, alive: Callable[[int], bool] = pid_alive
    ) -> list[TrainerInfo]:
        """Live trainer reports; files of dead PIDs or older than `stale_after_s` are removed."""
        reports = []
        for path in sorted(self.trainers.glob("*.json")):
            try:
                body = json.loads(path.read_text(encoding="utf-8"))
                pid = int(body["pid"])
                updated = float(body["t"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.debug("ignoring unreadable trainer report %s: %s", path, exc)
                continue
            if not alive(pid) or now - updated > stale_after_s:
                log.info("removing stale trainer report %s (pid %d, %.0f s old)", path.name, pid, now - updated)
                path.unlink(missing_ok=True)
                continue
            values = {k: v for k, v in body.items() if k in _TRAINER_FIELDS}
            reports.append(TrainerInfo(**{**values, "pid": pid, "updated_t": updated}))
        return reports
