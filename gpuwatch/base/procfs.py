"""What /proc says about a process: alive or not, its owner, start time, run state and trainer variables.

Remediation, rank mapping and the runtime directory all need to recognise one process over time:
the PID with its start time (field 22 of /proc/PID/stat) is that identity, so a recycled PID is
never taken for the process that had it before. `known_identity` reads a process's identity once
and afterwards only its stat (a recycled PID has another start time): a node's hang polls then read
one small file per rank, not four. Files are read with one os.read each (a third of pathlib's cost).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TRAINER_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "GPUWATCH_JOB_ID")
_ENVIRON_CACHE_MAX = 4096
_IDENTITY_CACHE_MAX = 4096
_READ_CHUNK = 64 * 1024  # /proc/PID/status is about 1.5 KB and stat a few hundred bytes: one read each
_READ_MAX = 1 << 26  # an environment may be megabytes (ARG_MAX); nothing here is larger


@dataclass(frozen=True)
class Identity:
    """Who a process is now: its start time (with the pid, the process), user ids, and program."""

    start_time: int
    started_t: float | None  # the start as Unix time (None without /proc/stat's btime)
    uids: tuple[int, ...]  # real, effective, saved, filesystem (empty when /proc/PID/status is unreadable)
    exe: str | None  # /proc/PID/exe's target (None when unreadable: a kernel thread, no permission)


class ProcFs:
    """Reads /proc (a root given for tests); environments are cached per process, as they never change."""

    def __init__(self, root: str | os.PathLike[str] = "/proc") -> None:
        self.root = Path(root)
        self._environ: dict[tuple[int, int | None], dict[str, str] | None] = {}
        self._identities: dict[tuple[int, int], Identity] = {}
        self._boot_time: float | None = None

    def start_time(self, pid: int) -> int | None:
        """Field 22 of /proc/PID/stat (clock ticks after boot): with the PID, a process's identity."""
        fields = self._stat_fields(pid)
        return int(fields[19]) if fields else None

    def boot_time(self) -> float | None:
        """`btime` of /proc/stat, read once."""
        if self._boot_time is None:
            try:
                for line in (self.root / "stat").read_text().splitlines():
                    if line.startswith("btime "):
                        self._boot_time = float(line.split()[1])
                        break
            except (OSError, ValueError, IndexError):
                return None
        return self._boot_time

    def identity(self, pid: int) -> Identity | None:
        """The process's start time, uids and program now; None when it is gone or has ended."""
        fields = self._stat_fields(pid)
        if fields is None or fields[0] in {"Z", "X"}:
            return None
        return self._read_identity(pid, fields)

    def known_identity(self, pid: int) -> Identity | None:
        """As `identity`, read in full once per process (pid and start time); later only its stat is read.

        For watching ranks, not for a decision to signal one: uids or program changed since the first
        read are not seen here (gpuwatch.remediation.signals reads `identity` at the moment it signals).
        """
        fields = self._stat_fields(pid)
        if fields is None or fields[0] in {"Z", "X"}:
            return None
        key = (pid, int(fields[19]))
        known = self._identities.get(key)
        if known is None:
            known = self._read_identity(pid, fields)
            if not known.uids:  # status unreadable now (out of descriptors): read it again next time
                return known
            if len(self._identities) >= _IDENTITY_CACHE_MAX:
                self._identities.clear()
            self._identities[key] = known
        return known

    def _read_identity(self, pid: int, fields: list[str]) -> Identity:
        try:
            status = self._read(pid, "status").decode(errors="replace")
        except OSError:
            status = ""
        uids = next((line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")), [])
        exe = self.exe(pid)
        boot, start = self.boot_time(), int(fields[19])
        started_t = boot + start / os.sysconf("SC_CLK_TCK") if boot is not None else None
        return Identity(start, started_t, tuple(int(u) for u in uids if u.isdigit()), exe)

    def exe(self, pid: int) -> str | None:
        """/proc/PID/exe's target (one readlink); None when unreadable (gone, a kernel thread, no permission)."""
        try:
            return os.readlink(f"{self.root}/{pid}/exe")
        except OSError:
            return None

    def cpu_ns(self, pid: int) -> int | None:
        """CPU time of all the process's threads so far, in ns; None when it is gone.

        The larger of the threads' schedstat sums (exact: a thread that ran 100 µs shows it) and
        stat's utime + stime (clock ticks, which miss a thread that wakes for microseconds, but are
        there where schedstats read 0, as in some sandboxes).
        """
        fields = self._stat_fields(pid)
        if not fields:
            return None
        ticks_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        total = 0
        try:
            tasks = list((self.root / str(pid) / "task").iterdir())
        except OSError:
            tasks = []
        for task in tasks:
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
        return max(total, ticks_ns)

    def main_thread_cpu_ns(self, pid: int) -> int | None:
        """CPU time of the process's main thread (its task `pid`) so far, in ns; None when it is gone.

        A training loop runs there; the link's reporting thread and NCCL's or the DataLoader's threads
        do not, so a loop that is wedged shows a still main thread while those tick. The larger of
        its schedstat (exact) and its stat's utime + stime (clock ticks), as cpu_ns.
        """
        task = f"task/{pid}"
        try:
            stat = self._read(pid, f"{task}/stat").decode(errors="replace")
        except OSError:
            return None
        fields = stat[stat.rfind(")") + 2 :].split()
        try:
            ticks_ns = (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        except (ValueError, IndexError):
            return None
        try:
            exact = int(self._read(pid, f"{task}/schedstat").split()[0])
        except (OSError, ValueError, IndexError):
            exact = 0
        return max(exact, ticks_ns)

    def parent(self, pid: int) -> int | None:
        """The parent's pid, None when the process is gone (or is pid 1's child of nobody)."""
        fields = self._stat_fields(pid)
        ppid = int(fields[1]) if fields else 0
        return ppid or None

    def run_state(self, pid: int) -> str | None:
        """The one-letter state of /proc/PID/stat (R, S, D, T stopped, t traced, Z zombie), None when gone."""
        fields = self._stat_fields(pid)
        return fields[0] if fields else None

    def alive(self, pid: int, start_time: int | None) -> bool:
        """The same process still runs (a zombie has finished; a different start time is a recycled PID)."""
        fields = self._stat_fields(pid)
        if fields is None or fields[0] in {"Z", "X"}:
            return False
        return start_time is None or int(fields[19]) == start_time

    def liveness(self, pid: int, start_time: int | None) -> bool | None:
        """As `alive`, but None when /proc could not be read for another reason than the process being
        gone (EMFILE, ENOMEM: the reader's trouble, which must never make a live process look gone)."""
        try:
            text = self._read(pid, "stat")
        except (FileNotFoundError, ProcessLookupError):
            return False
        except OSError:
            return None
        fields = text.rpartition(b")")[2].decode(errors="replace").split()
        if len(fields) <= 19 or fields[0] in {"Z", "X"}:
            return False
        return start_time is None or int(fields[19]) == start_time

    def uid(self, pid: int) -> int | None:
        """The process's real uid (status), else its /proc directory's owner; None when it is gone.

        Not the directory's owner first: a process that changed its uids is non-dumpable, and /proc
        then shows its files as root's.
        """
        identity = self.identity(pid)
        if identity is not None and identity.uids:
            return identity.uids[0]
        try:
            return (self.root / str(pid)).stat().st_uid
        except OSError:
            return None

    def environ(self, pid: int, start_time: int | None = None) -> dict[str, str] | None:
        """The trainer variables of PID's environment at exec; None when unreadable (gone, other user).

        `start_time`: the process's, just read by the caller (else it is read here). An empty read is
        not cached: the kernel shows an empty environ while exec sets up the new stack, and the
        process keeps its PID and start time across that exec.
        """
        key = (pid, start_time if start_time is not None else self.start_time(pid))
        if key in self._environ:
            return self._environ[key]
        try:
            raw: bytes | None = self._read(pid, "environ")
        except OSError:
            raw = None
        env = None if raw is None else self._trainer_variables(raw)
        if raw != b"":
            if len(self._environ) > _ENVIRON_CACHE_MAX:
                self._environ.clear()
            self._environ[key] = env
        return env

    @staticmethod
    def _trainer_variables(raw: bytes) -> dict[str, str]:
        env = {}
        for entry in raw.split(b"\0"):
            name, sep, value = entry.partition(b"=")
            if sep and name.decode(errors="replace") in (*TRAINER_ENV_KEYS, "CUDA_VISIBLE_DEVICES"):
                env[name.decode()] = value.decode(errors="replace")
        return env

    def _stat_fields(self, pid: int) -> list[str] | None:
        """/proc/PID/stat after the command name (which may hold spaces): state is [0], starttime [19]."""
        try:
            text = self._read(pid, "stat")
        except OSError:
            return None
        fields = text.rpartition(b")")[2].decode(errors="replace").split()
        return fields if len(fields) > 19 else None

    def _read(self, pid: int, name: str, limit: int = _READ_MAX) -> bytes:
        """The file `name` of PID's directory, whole (up to `limit`); raises OSError as open and read do."""
        fd = os.open(f"{self.root}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            size = 0
            while size < limit:
                chunk = os.read(fd, min(limit - size, _READ_CHUNK))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
