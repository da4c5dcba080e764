"""The runtime directory, the contract with trainers: status.json out, trainers/<pid>.json in.

Every write is temp file + rename, so a trainer never reads half a file. trainers/ is sticky and
world-writable (like /tmp) because ranks run as their own users, so everything in it is untrusted
input from any local account:

* an entry is read only when its name is `<pid>.json`, without following a symlink or blocking on
  a FIFO (O_NOFOLLOW | O_NONBLOCK), only when it is a regular file of at most MAX_REPORT_BYTES,
  and at most MAX_ENTRIES entries are looked at per read;
* its JSON is checked field by field (types, ranges, finiteness, lengths): one bad field rejects the
  report, logged once per version of the file, never an exception out of a read;
* a report is attributed to process `<pid>` only when the file's owner is root or the owner of that
  process, its `pid` field is the file name, and it was written after the process started. The
  sticky bit stops one user from replacing or removing another's file; these checks stop one user
  from speaking for another's process (so the daemon never signals it on their word).

The last report of a process that is gone stays readable for DEAD_KEEP_S, so remediation learns how
a rank ended (`ended`, gpuwatch.trainer.contract), then it is removed.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.model import Snapshot, TrainerInfo
from gpuwatch.procfs import ProcFs
from gpuwatch.trainer.contract import (
    ENDED_VALUES,
    MAX_REPORT_BYTES,
    STATUS_FILE,
    TRAINERS_DIR,
    Status,
    StatusGpu,
    report_name,
    report_pid,
)

log = logging.getLogger("gpuwatch.runtime")

MAX_ENTRIES = 1024  # entries of trainers/ looked at per read: a flood of files cannot make a tick slow
DEAD_KEEP_S = 30.0  # a gone process's last report is kept this long for remediation, then removed
JUNK_KEEP_S = 600.0  # an entry that is no valid report is removed once it is this old
MAX_PID = 1 << 22  # the kernel's pid_max ceiling
_MAX_INT = 1 << 62
_MAX_TEXT = 256
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_LOGGED_MAX = 4096


class ReportError(ValueError):
    """A report that is not one: the message names the field and what is wrong."""


def _int(low: int, high: int) -> Any:
    def check(value: Any) -> int:
        if type(value) is not int or not low <= value <= high:
            raise ReportError(f"expected an integer in [{low}, {high}], got {_short(value)}")
        return value

    return check


def _number(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ReportError(f"expected a finite number >= 0, got {_short(value)}")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT or not value.isprintable():
        raise ReportError(f"expected printable text of at most {_MAX_TEXT} characters, got {_short(value)}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ReportError(f"expected true or false, got {_short(value)}")
    return value


def _ended(value: Any) -> str:
    if value not in ENDED_VALUES:
        raise ReportError(f"expected one of {', '.join(ENDED_VALUES)}, got {_short(value)}")
    return str(value)


_COUNT = _int(0, _MAX_INT)
_RANK = _int(0, 1 << 20)
# Each field of a TrainerReport but `t` and `pid`, and its check; null is always allowed. Others are ignored.
_FIELDS: dict[str, Any] = {
    "rank": _RANK,
    "local_rank": _RANK,
    "world_size": _int(1, 1 << 20),
    "local_world_size": _int(1, 1 << 20),
    "job_id": _text,
    "gpu_uuid": _text,
    "step": _COUNT,
    "first_step": _COUNT,
    "step_time_s": _number,
    "grad_norm": _number,
    "grad_norm_var": _number,
    "reserved_bytes": _COUNT,
    "allocated_bytes": _COUNT,
    "inactive_split_bytes": _COUNT,
    "num_alloc_retries": _COUNT,
    "num_ooms": _COUNT,
    "stop_requested": _flag,
    "allow_drills": _flag,
    "ended": _ended,
    "recovery": _text,
}


def parse_report(data: bytes, pid: int) -> TrainerInfo:
    """One report's bytes as a TrainerInfo, every field checked.

    Raises:
        ReportError: naming the first bad field (or the JSON error).
    """
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: '[' * 60000 is valid-looking JSON
        raise ReportError(f"not JSON: {str(exc)[:80] or type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ReportError("not a JSON object")
    if body.get("pid") != pid or type(body.get("pid")) is not int:
        raise ReportError(f"pid: {_short(body.get('pid'))} is not the file's pid {pid}")
    try:
        updated = _number(body.get("t"))
    except ReportError as exc:
        raise ReportError(f"t: {exc}") from None
    values: dict[str, Any] = {}
    for name, check in _FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        try:
            values[name] = check(value)
        except ReportError as exc:
            raise ReportError(f"{name}: {exc}") from None
    return TrainerInfo(pid=pid, updated_t=updated, **values)


@dataclass(frozen=True)
class Report:
    """A validated report and whether the process it speaks for still runs."""

    info: TrainerInfo
    owner_uid: int
    alive: bool

    @property
    def running(self) -> bool:
        """The process runs and its link has not said how it ended."""
        return self.alive and self.info.ended is None


STATUS_REFRESH_S = 30.0  # status.json's `t` is at most this old while the daemon runs


def write_json_atomic(path: Path, body: Any) -> None:
    """Write JSON to `path` through a temp file in the same directory and an atomic rename.

    Readers see the old file or the new one, never a part. The temp name is fixed (`.<name>.tmp`):
    the daemon is the only writer (the state-dir lock) and the directory is root's, and one open with
    O_NOFOLLOW costs a third of mkstemp's name search at every sample.
    """
    data = json.dumps(body, separators=(",", ":")).encode("utf-8")  # the C encoder; json.dump is pure Python
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            os.fchmod(fd, 0o644)  # the umask may have cut it; trainers of any user read status.json
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def status_body(snapshot: Snapshot) -> Status:
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


class RuntimeDir:
    """`/run/gpuwatch` (configurable): status.json and the trainers' reports."""

    def __init__(self, path: str | Path, proc: ProcFs | None = None) -> None:
        self.path = Path(path)
        self.trainers = self.path / TRAINERS_DIR
        self.proc = proc or ProcFs()
        self._logged: set[tuple[str, int, int, int]] = set()
        self._flooded = False
        self._status_gpus: list[StatusGpu] | None = None  # what status.json says now, but for `t`
        self._status_t = float("-inf")

    def prepare(self) -> None:
        """Create the directory and the sticky, world-writable trainers/.

        Raises:
            ConfigError: one line naming the path (read-only file system, not a directory, permissions).
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.trainers.mkdir(exist_ok=True)
            if self.trainers.is_symlink() or not self.trainers.is_dir():
                raise OSError(errno.ENOTDIR, "not a directory")
            os.chmod(self.trainers, 0o1777)
            probe = tempfile.NamedTemporaryFile(dir=self.path, prefix=".gpuwatch-probe-")
            probe.close()
        except OSError as exc:
            where = exc.filename or self.trainers
            raise ConfigError(f"runtime_dir: cannot prepare {where}: {exc.strerror or exc}") from None

    def write_status(self, snapshot: Snapshot) -> None:
        """Replace status.json when a GPU's part of it changed, else every STATUS_REFRESH_S.

        Each rank re-reads the file when its mtime moves, so an unchanged file rewritten every sample
        would cost every rank a read and a parse each second for nothing; `t` still shows within
        STATUS_REFRESH_S that the daemon is alive. A failed write is tried again at the next sample.
        """
        body = status_body(snapshot)
        if body["gpus"] == self._status_gpus and snapshot.t - self._status_t < STATUS_REFRESH_S:
            return
        write_json_atomic(self.path / STATUS_FILE, body)
        self._status_gpus, self._status_t = body["gpus"], snapshot.t

    def read_reports(self) -> list[Report]:
        """Every valid, attributable report in trainers/ (of running and of gone processes), by pid.

        Never raises for what is in the directory; removes reports of processes gone for DEAD_KEEP_S
        and junk older than JUNK_KEEP_S.

        Raises:
            OSError: trainers/ itself cannot be listed.
        """
        reports = []
        with os.scandir(self.trainers) as entries:
            for seen, entry in enumerate(entries):
                if seen >= MAX_ENTRIES:
                    if not self._flooded:
                        log.warning("%s holds more than %d entries: reading only the first", self.trainers, seen)
                        self._flooded = True
                    break
                pid = report_pid(entry.name)
                report = self._read_entry(entry.name, pid) if pid is not None else None
                if report is not None:
                    reports.append(report)
                elif pid is None:  # a writer's temp file, or junk: gone once clearly abandoned
                    self._remove_if_old(entry.name, JUNK_KEEP_S)
        return sorted(reports, key=lambda r: r.info.pid)

    def read_report(self, pid: int) -> Report | None:
        """The report of one pid (None when there is none, or it is invalid or not attributable)."""
        if not 0 < pid <= MAX_PID:
            return None
        return self._read_entry(report_name(pid), pid, remove=False)

    def _read_entry(self, name: str, pid: int, remove: bool = True) -> Report | None:
        path = self.trainers / name
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self._log_once(name, None, f"cannot open: {exc.strerror or exc}")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._log_once(name, st, "not a regular file")
                return None
            if st.st_size > MAX_REPORT_BYTES:
                self._log_once(name, st, f"{st.st_size} bytes, more than {MAX_REPORT_BYTES}")
                return None
            data = os.read(fd, MAX_REPORT_BYTES + 1)
        except OSError as exc:
            self._log_once(name, None, f"cannot read: {exc.strerror or exc}")
            return None
        finally:
            os.close(fd)
        try:
            info = parse_report(data, pid)
        except ReportError as exc:
            self._log_once(name, st, str(exc))
            return None
        return self._attribute(name, info, st, remove)

    def _attribute(self, name: str, info: TrainerInfo, st: os.stat_result, remove: bool) -> Report | None:
        """Tie the report to its process, or find that process gone (and drop the file in time).

        Ages are the file's mtime against the real clock (the kernel's, not the writer's `t`).
        """
        owner = st.st_uid
        started = self.proc.running_since(info.pid)
        process_uid = self.proc.uid(info.pid) if started is not None else None
        if process_uid is not None and started is not None and started <= st.st_mtime + 1.0:
            if owner not in {0, process_uid}:
                self._log_once(name, st, f"owned by uid {owner}, but pid {info.pid} runs as uid {process_uid}")
                return None
            return Report(info, owner, alive=True)
        # The process is gone, or the pid now belongs to a process started after the report.
        age = time.time() - st.st_mtime
        if remove and age > DEAD_KEEP_S:
            log.info("removing the report of gone pid %d (%s, %.0f s old)", info.pid, name, age)
            self._unlink(name)
            return None
        return Report(info, owner, alive=False)

    def _remove_if_old(self, name: str, keep_s: float) -> None:
        try:
            st = os.lstat(self.trainers / name)
        except OSError:
            return
        if time.time() - st.st_mtime > keep_s:
            log.info("removing %s from %s: not a trainer report", name, self.trainers)
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(self.trainers / name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove %s: %s", self.trainers / name, exc.strerror or exc)

    def _log_once(self, name: str, st: os.stat_result | None, why: str) -> None:
        """One line per version of a bad file: a rewrite of it is said again, a tick re-reading it is not."""
        key = (name, st.st_ino, st.st_mtime_ns, st.st_size) if st is not None else (name, 0, 0, 0)
        if key in self._logged:
            return
        if len(self._logged) >= _LOGGED_MAX:
            self._logged.clear()
        self._logged.add(key)
        log.warning("ignoring %s: %s", self.trainers / name, why)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
