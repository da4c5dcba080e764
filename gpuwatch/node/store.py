"""SQLite state (stdlib sqlite3, WAL): quarantines that survive restarts, findings history, incidents, drills.

One connection guarded by a lock: writes are rare (state changes, not samples), so a
single writer is simpler than a pool and never contends with scrapes (which read the Snapshot).

Quarantine changes the database has not taken yet (a full or read-only disk) wait in
PendingQuarantines, which is also a journal on disk (slotfile.Mirrored: beside the database and in
the runtime dir, each written in place): a restart before the disk recovers finds them there,
applies them before the first Snapshot, and writes them to the database once it can.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.base.slotfile import Mirrored
from gpuwatch.errors import StoreError
from gpuwatch.model import Action, Finding, Severity

log = logging.getLogger("gpuwatch.store")

SCHEMA = """
CREATE TABLE IF NOT EXISTS quarantine (
    uuid TEXT PRIMARY KEY, gpu INTEGER NOT NULL, reason TEXT NOT NULL, since REAL NOT NULL,
    auto INTEGER NOT NULL, drill INTEGER NOT NULL DEFAULT 0, epoch INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS epoch (uuid TEXT PRIMARY KEY, epoch INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS finding (
    id INTEGER PRIMARY KEY, opened REAL NOT NULL, closed REAL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
    rule TEXT NOT NULL, severity TEXT NOT NULL, reason TEXT NOT NULL, action TEXT NOT NULL, drill INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS finding_open ON finding (closed, uuid, rule);
CREATE TABLE IF NOT EXISTS decision (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, gpu INTEGER NOT NULL, uuid TEXT NOT NULL,
    kind TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL, drill INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS incident (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS auto_quarantine (uuid TEXT NOT NULL, t REAL NOT NULL);
CREATE INDEX IF NOT EXISTS auto_quarantine_uuid ON auto_quarantine (uuid, t);
CREATE TABLE IF NOT EXISTS held_finding (
    uuid TEXT NOT NULL, rule TEXT NOT NULL, t REAL NOT NULL, severity TEXT NOT NULL, reason TEXT NOT NULL,
    action TEXT NOT NULL, PRIMARY KEY (uuid, rule)
);
CREATE TABLE IF NOT EXISTS drill_run (
    id INTEGER PRIMARY KEY, t REAL NOT NULL, drill TEXT NOT NULL, result TEXT NOT NULL, body TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class QuarantineRecord:
    """A persisted quarantine, keyed by GPU uuid (indexes can change across reboots)."""

    uuid: str
    gpu: int
    reason: str
    since: float
    auto: bool
    drill: bool
    epoch: int


_QUARANTINE_COLUMNS = "uuid, gpu, reason, since, auto, drill, epoch"
JOURNAL_NAME = "quarantine.journal"
JOURNAL_SLOT_BYTES = 256 * 1024  # 64 GPUs of 1,000-character reasons fit three times over
JOURNAL_REASON_CHARS = 1000


class PendingQuarantines(MutableMapping[str, QuarantineRecord | None]):
    """uuid → the quarantine (or None: its release) in force but not yet in the database, oldest first.

    Every change is written to the journal at once, before the database is tried, so nothing
    decided waits in memory alone. A record whose database write succeeds is deleted from it. The
    journal is synced (fdatasync) only when the database refuses a write: on a healthy disk a record
    lives there for a moment, and the database's own commit is what makes it durable.
    """

    def __init__(self, journal: Mirrored) -> None:
        self._journal = journal
        self._items: dict[str, QuarantineRecord | None] = {}
        try:
            rows = json.loads(journal.payload or b"[]")
            for uuid, row in rows:
                self._items[str(uuid)] = None if row is None else QuarantineRecord(str(uuid), *row)
        except (ValueError, TypeError):
            log.error("%s: unreadable journal of unsaved quarantine changes; ignored", journal.what)
            self._items = {}

    def __getitem__(self, uuid: str) -> QuarantineRecord | None:
        return self._items[uuid]

    def __setitem__(self, uuid: str, record: QuarantineRecord | None) -> None:
        self._items[uuid] = record
        self._save()

    def __delitem__(self, uuid: str) -> None:
        del self._items[uuid]
        self._save()

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def sync(self) -> None:
        self._journal.sync()

    def close(self) -> None:
        self._journal.close()

    def _save(self) -> None:
        rows = [
            [uuid, None if r is None else [r.gpu, r.reason[:JOURNAL_REASON_CHARS], r.since, r.auto, r.drill, r.epoch]]
            for uuid, r in self._items.items()
        ]
        self._journal.write(json.dumps(rows).encode())


class Store:
    """The daemon's persistent state in `<state_dir>/gpuwatch.db`.

    Every commit is synchronous=FULL: a write that returned survives a crash or a power cut, so an
    API answer given after it is a promise kept. A database that fails its integrity check at
    start is renamed aside (kept for a post-mortem) and its quarantines are carried over where
    they can still be read; it is never silently emptied.
    """

    def __init__(self, path: str | Path, journal_copies: Sequence[Path] = ()) -> None:
        """`journal_copies`: where the journal of unsaved quarantine changes is kept besides the state dir."""
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"{self.path.parent}: cannot create state directory: {exc.strerror or exc}") from None
        if self.path.is_file() and self.path.stat().st_size == 0:
            log.warning("%s is empty (0 bytes): starting without persisted quarantines or history", self.path)
        salvaged: list[tuple[Any, ...]] = []
        problem = self._integrity_problem()
        if problem:
            salvaged = self._salvage_quarantines()
            aside = self._move_aside()
            log.error(
                "%s failed its integrity check (%s): kept as %s; new database with %d salvaged quarantine(s)",
                self.path,
                problem,
                aside,
                len(salvaged),
            )
        self._make_private()
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            if salvaged:
                self._db.executemany(
                    f"INSERT OR REPLACE INTO quarantine ({_QUARANTINE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)", salvaged
                )
                self._db.executemany("INSERT OR REPLACE INTO epoch VALUES (?, ?)", [(r[0], r[6]) for r in salvaged])
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"{self.path}: cannot open state database: {exc}") from None
        self._lock = threading.Lock()
        journal = Mirrored([self.path.with_name(JOURNAL_NAME), *journal_copies], JOURNAL_SLOT_BYTES, JOURNAL_NAME)
        self.pending = PendingQuarantines(journal)
        if self.pending:
            log.warning(
                "%d quarantine change(s) the database could not take before the restart are in force again "
                "from %s; written to the database when it can take them",
                len(self.pending),
                JOURNAL_NAME,
            )

    def _make_private(self) -> None:
        """Create the database 0600 whatever the umask, and make one found wider 0600 (SQLite gives its -wal
        and -shm files the database's mode): quarantine reasons and incidents are root's business."""
        try:
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            for suffix in ("", "-wal", "-shm"):
                path = Path(f"{self.path}{suffix}")
                if path.is_symlink() or not path.is_file():
                    continue
                info = path.stat()
                mode = stat.S_IMODE(info.st_mode)
                if mode & 0o077:
                    os.chmod(path, 0o600)
                    if not suffix and info.st_size:  # an empty file showed nobody anything
                        log.warning("%s was mode %04o: made it 0600 (quarantines, incidents)", path, mode)
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot create the state database: {exc.strerror or exc}") from None

    def _integrity_problem(self) -> str:
        """'' when the file is absent or passes PRAGMA quick_check, else what is wrong in a few words."""
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return ""
        try:
            db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                rows = db.execute("PRAGMA quick_check").fetchall()
            finally:
                db.close()
        except sqlite3.Error as exc:
            if "locked" in str(exc) or "unable to open" in str(exc):
                return ""  # not corruption: opening it for real will say what is wrong
            return str(exc)
        problems = [str(r[0]) for r in rows if r[0] != "ok"]
        return "; ".join(problems[:3])

    def _salvage_quarantines(self) -> list[tuple[Any, ...]]:
        try:
            db = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
            try:
                return db.execute(f"SELECT {_QUARANTINE_COLUMNS} FROM quarantine").fetchall()
            finally:
                db.close()
        except sqlite3.Error:
            return []

    def _move_aside(self) -> Path:
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        for suffix in ("", "-wal", "-shm"):
            source = Path(f"{self.path}{suffix}")
            if source.exists():
                try:
                    os.chmod(source, 0o600)  # kept for a post-mortem, by root only
                    source.rename(f"{aside}{suffix}")
                except OSError as exc:
                    raise StoreError(f"{source}: corrupt, and cannot be moved aside: {exc.strerror or exc}") from None
        return aside

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                yield self._db
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass  # a full disk can fail the rollback too; the error below is what matters
                if self.pending:
                    self.pending.sync()  # the database refused: what it owes must survive a power cut too
                raise StoreError(f"{self.path}: {exc}") from None

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"{self.path}: {exc}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self.pending.close()

    # quarantine ---------------------------------------------------------------------------
    def quarantines(self) -> dict[str, QuarantineRecord]:
        """The quarantines in force: the database's, with the pending changes it has not taken yet on top."""
        rows = self._query("SELECT uuid, gpu, reason, since, auto, drill, epoch FROM quarantine")
        found = {r[0]: QuarantineRecord(r[0], r[1], r[2], r[3], bool(r[4]), bool(r[5]), r[6]) for r in rows}
        for uuid, record in self.pending.items():
            if record is None:
                found.pop(uuid, None)
            else:
                found[uuid] = record
        return found

    def epochs(self) -> dict[str, int]:
        found = {uuid: epoch for uuid, epoch in self._query("SELECT uuid, epoch FROM epoch")}
        found.update({uuid: r.epoch for uuid, r in self.pending.items() if r is not None})
        return found

    def set_quarantine(self, record: QuarantineRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO quarantine VALUES (?, ?, ?, ?, ?, ?, ?)",
                (record.uuid, record.gpu, record.reason, record.since, record.auto, record.drill, record.epoch),
            )
            db.execute("INSERT OR REPLACE INTO epoch VALUES (?, ?)", (record.uuid, record.epoch))

    def clear_quarantine(self, uuid: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM quarantine WHERE uuid = ?", (uuid,))

    # repeat offenders and findings held until an operator releases -------------------------
    def count_auto_quarantine(self, uuid: str, t: float, since: float) -> int:
        """Record an automatic quarantine of `uuid` at `t`; how many it has had since `since` (this one included)."""
        with self._tx() as db:
            db.execute("INSERT INTO auto_quarantine VALUES (?, ?)", (uuid, t))
            db.execute("DELETE FROM auto_quarantine WHERE uuid = ? AND t < ?", (uuid, since))
            return int(db.execute("SELECT COUNT(*) FROM auto_quarantine WHERE uuid = ?", (uuid,)).fetchone()[0])

    def hold_finding(self, uuid: str, finding: Finding) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO held_finding VALUES (?, ?, ?, ?, ?, ?)",
                (uuid, finding.rule, finding.t, finding.severity.value, finding.reason, finding.action.value),
            )

    def drop_held_findings(self, uuid: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM held_finding WHERE uuid = ?", (uuid,))

    def held_findings(self) -> dict[str, list[Finding]]:
        """uuid → findings held on that GPU until an operator releases it (repeat offender, failed validation)."""
        held: dict[str, list[Finding]] = {}
        for uuid, rule, t, severity, reason, action in self._query(
            "SELECT uuid, rule, t, severity, reason, action FROM held_finding ORDER BY t"
        ):
            held.setdefault(uuid, []).append(Finding(rule, Severity(severity), reason, Action(action), t, uuid=uuid))
        return held

    # findings and decisions ---------------------------------------------------------------
    def sync_findings(self, uuid: str, gpu: int, active: list[Finding], now: float) -> None:
        """Open a row for each finding that newly appeared on this GPU, close those that went away."""
        open_rows = {
            rule: row_id
            for row_id, rule in self._query("SELECT id, rule FROM finding WHERE closed IS NULL AND uuid = ?", (uuid,))
        }
        active_rules = {f.rule: f for f in active}
        if set(open_rows) == set(active_rules):
            return
        with self._tx() as db:
            for rule, row_id in open_rows.items():
                if rule not in active_rules:
                    db.execute("UPDATE finding SET closed = ? WHERE id = ?", (now, row_id))
            for rule, f in active_rules.items():
                if rule not in open_rows:
                    db.execute(
                        "INSERT INTO finding (opened, gpu, uuid, rule, severity, reason, action, drill)"
                        " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (f.t, gpu, uuid, rule, f.severity.value, f.reason, f.action.value, f.drill),
                    )

    def findings(self, limit: int = 500, gpu: int | None = None) -> list[dict[str, Any]]:
        where, args = ("WHERE gpu = ?", (gpu,)) if gpu is not None else ("", ())
        rows = self._query(
            "SELECT opened, closed, gpu, uuid, rule, severity, reason, action, drill FROM finding "
            f"{where} ORDER BY id DESC LIMIT ?",
            (*args, limit),
        )
        keys = ("opened", "closed", "gpu", "uuid", "rule", "severity", "reason", "action", "drill")
        return [dict(zip(keys, r[:-1] + (bool(r[-1]),), strict=True)) for r in rows]

    def add_decision(self, t: float, gpu: int, uuid: str, kind: str, state: str, reason: str, drill: bool) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO decision (t, gpu, uuid, kind, state, reason, drill) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (t, gpu, uuid, kind, state, reason, drill),
            )

    def prune(self, older_than: float, incidents_per_user: int = 1000) -> int:
        """Drop closed findings, decisions and incidents older than `older_than`, and each user's incidents
        beyond their newest `incidents_per_user` (one user's flood never evicts another's)."""
        with self._tx() as db:
            n = db.execute("DELETE FROM finding WHERE closed IS NOT NULL AND closed < ?", (older_than,)).rowcount
            n += db.execute("DELETE FROM decision WHERE t < ?", (older_than,)).rowcount
            n += db.execute("DELETE FROM incident WHERE t < ?", (older_than,)).rowcount
            n += db.execute(
                "DELETE FROM incident WHERE id IN (SELECT id FROM (SELECT id, ROW_NUMBER() OVER "
                "(PARTITION BY json_extract(body, '$.uid') ORDER BY id DESC) AS newer FROM incident) WHERE newer > ?)",
                (incidents_per_user,),
            ).rowcount
        return n

    # incidents and drills (JSON bodies: their shape belongs to remediation and drills) ------------
    def add_incident(self, t: float, body: dict[str, Any]) -> int:
        with self._tx() as db:
            cur = db.execute("INSERT INTO incident (t, body) VALUES (?, ?)", (t, json.dumps(body)))
            return int(cur.lastrowid or 0)

    def update_incident(self, incident_id: int, body: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute("UPDATE incident SET body = ? WHERE id = ?", (json.dumps(body), incident_id))

    def incidents(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._query("SELECT id, t, body FROM incident ORDER BY id DESC LIMIT ?", (limit,))
        return [{"id": r[0], "t": r[1], **json.loads(r[2])} for r in rows]

    def add_drill_run(self, t: float, drill: str, result: str, body: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT INTO drill_run (t, drill, result, body) VALUES (?, ?, ?, ?)",
                (t, drill, result, json.dumps(body)),
            )

    def drill_runs(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = self._query("SELECT t, drill, result, body FROM drill_run ORDER BY id DESC LIMIT ?", (limit,))
        return [{"t": r[0], "drill": r[1], "result": r[2], **json.loads(r[3])} for r in rows]
