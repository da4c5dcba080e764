"""The runtime directory, the daemon's side of the trainer contract: status.json out, reports in.

The directory is root's (0755): nothing in it can be written by another account. status.json is
replaced atomically (temp file + rename), so a trainer never reads half a file. Trainers report
over the Unix socket beside it (gpuwatch.reports: the kernel names each sender), so no user can fill,
squat or hide anything the daemon or another user's ranks need.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

from gpuwatch.base.procfs import ProcFs
from gpuwatch.errors import ConfigError
from gpuwatch.model import Snapshot
from gpuwatch.reports import Report, ReportBoard, ReportServer
from gpuwatch.trainer.contract import REPORT_SOCKET, STATUS_FILE, Status, StatusGpu

log = logging.getLogger("gpuwatch.runtime")

STATUS_REFRESH_S = 30.0  # status.json's `t` is at most this old while the daemon runs
OLD_REPORTS_DIR = "trainers"
"""Where releases before the report socket had ranks write report files: a world-writable (1777)
directory that nothing reads any more, so it is removed at start rather than left for any user to fill."""


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
    """`/run/gpuwatch` (configurable): status.json, and the report socket with the board it fills."""

    def __init__(self, path: str | Path, proc: ProcFs | None = None) -> None:
        self.path = Path(path)
        self.socket_path = self.path / REPORT_SOCKET
        self.board = ReportBoard(proc)
        self.server = ReportServer(self.socket_path, self.board)
        self._status_gpus: list[StatusGpu] | None = None  # what status.json says now, but for `t`
        self._status_t = float("-inf")
        self.status_write_errors = 0
        self._status_error = ""

    def prepare(self) -> None:
        """Create the directory (0755) and the report socket, and start taking reports.

        Raises:
            ConfigError: one line naming the path (read-only file system, not a directory, permissions).
        """
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            st = os.lstat(self.path)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, "not a directory", str(self.path))
            if st.st_uid != os.geteuid():  # its owner could replace status.json or plant a socket of their own
                raise OSError(errno.EPERM, f"owned by uid {st.st_uid}, not by the daemon's uid {os.geteuid()}")
            os.chmod(self.path, 0o755)  # ranks of any user read status.json; only the daemon writes here
            self._remove_old_reports_dir()
            probe = tempfile.NamedTemporaryFile(dir=self.path, prefix=".gpuwatch-probe-")
            probe.close()
            self.server.bind()
        except OSError as exc:
            where = exc.filename or self.socket_path
            raise ConfigError(f"runtime_dir: cannot prepare {where}: {exc.strerror or exc}") from None
        self.server.start()

    def _remove_old_reports_dir(self) -> None:
        """Remove an older release's `trainers/` and say so: ranks that still write there report nothing.

        shutil.rmtree works through directory descriptors here, so a link a user planted inside is
        removed, never followed; a link in its place (the directory is root's) is only unlinked.
        """
        old = self.path / OLD_REPORTS_DIR
        try:
            st = os.lstat(old)
        except FileNotFoundError:
            return
        try:
            if stat.S_ISDIR(st.st_mode):
                files = sum(name.endswith(".json") for _, _, names in os.walk(old) for name in names)
                shutil.rmtree(old)
            else:
                files = 0
                old.unlink()
        except OSError as exc:  # leftovers never keep the daemon from starting: nothing reads them
            log.warning("runtime_dir: cannot remove %s left by an older gpuwatch: %s", old, exc.strerror or exc)
            return
        log.warning(
            "runtime_dir: removed %s (%d report file(s)) left by an older gpuwatch: ranks now report over %s, "
            "so a job whose environment has an older gpuwatch reports nothing until it is upgraded",
            old,
            files,
            self.socket_path,
        )

    def version(self) -> object:
        """Changes whenever the runtime dir's metrics may have (the metrics render cache key)."""
        return (sum(self.board.refused.values()), self.board.connections(), self.status_write_errors)

    def close(self) -> None:
        """Stop taking reports (at daemon shutdown)."""
        self.server.close()
        self.board.close()

    def write_status(self, snapshot: Snapshot) -> None:
        """Replace status.json when a GPU's part of it changed, else every STATUS_REFRESH_S.

        Each rank re-reads the file when its mtime moves, so an unchanged file rewritten every sample
        would cost every rank a read and a parse each second for nothing; `t` still shows within
        STATUS_REFRESH_S that the daemon is alive. A failed write (a full or read-only file system) never
        reaches the sampler, whose stops must still go out: it is counted, logged once until its cause
        changes, and tried again at the next sample.
        """
        body = status_body(snapshot)
        if body["gpus"] == self._status_gpus and snapshot.t - self._status_t < STATUS_REFRESH_S:
            return
        path = self.path / STATUS_FILE
        try:
            write_json_atomic(path, body)
        except OSError as exc:
            self.status_write_errors += 1
            error = exc.strerror or str(exc)
            if error != self._status_error:
                log.warning(
                    "runtime_dir: cannot write %s: %s; ranks see quarantines by their stop signal only, "
                    "tried again at every sample",
                    path,
                    error,
                )
                self._status_error = error
            return
        if self._status_error:
            log.warning("runtime_dir: %s written again", path)
            self._status_error = ""
        self._status_gpus, self._status_t = body["gpus"], snapshot.t

    def read_reports(self) -> list[Report]:
        """Every valid report (of running and of gone processes), by pid, with what arrived up to now."""
        self.server.poll()
        return self.board.reports()

    def read_report(self, pid: int) -> Report | None:
        """The report of one pid (None when it never sent a valid one), with what arrived up to now."""
        self.server.poll()
        return self.board.report(pid)
