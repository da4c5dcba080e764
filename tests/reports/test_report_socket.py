"""The report socket as an attacker or a bad day would use it: every sender is a local account.

Every case sends hostile messages (or descriptors, or floods) beside one honest rank, and asserts
that the honest report is still there, the hostile input is refused with one log line (rate-limited
per uid) and counted, and nothing blocks.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.base.procfs import ProcFs
from gpuwatch.base.unixsock import address as socket_address
from gpuwatch.errors import ConfigError
from gpuwatch.node import runtime as runtime_module
from gpuwatch.node.runtime import RuntimeDir
from gpuwatch.reports import board as board_module
from gpuwatch.reports import parse_report
from gpuwatch.reports.board import DEAD_KEEP_S, ReportBoard
from gpuwatch.reports.parse import ReportError
from gpuwatch.reports.server import FLOOD_DROPS
from gpuwatch.trainer.channel import StepPageWriter
from gpuwatch.trainer.contract import MAX_REPORT_BYTES, PAUSE_UNTIL_SLOT, REPORT_PROTOCOL, STEP_SLOT, hello
from tests.reporting import FakeRank

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

ROOT = os.geteuid() == 0
STRANGER_UID = 54_321  # a uid that runs nothing here: "another local user"


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[RuntimeDir]:
    rt = RuntimeDir(tmp_path / "run")
    rt.prepare()
    yield rt
    rt.close()


@pytest.fixture
def honest(runtime: RuntimeDir) -> Iterator[FakeRank]:
    rank = FakeRank()
    rank.report(runtime.path, t=time.time(), job_id="job", step=3, gpu_uuid="GPU-right")
    yield rank
    rank.kill()
    rank.wait()


def connect(rt: RuntimeDir, *, greet: bool = True) -> socket.socket:
    """A connection as a rank makes it: its hello first (`greet=False`: as a gpuwatch before the hello)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with socket_address(rt.socket_path) as address:
        sock.connect(address)
    if greet:
        sock.send(hello(os.getpid()))
    return sock


def send_with_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())])


def body(**fields: Any) -> bytes:
    return json.dumps({"t": time.time(), "pid": os.getpid(), "job_id": "mine", **fields}).encode()


def read_within(rt: RuntimeDir, seconds: float = 5.0) -> list[tuple[int, str | None, bool]]:
    """read_reports in a thread: a read that blocks fails the test instead of hanging it."""
    result: list[list[tuple[int, str | None, bool]]] = []

    def read() -> None:
        result.append([(r.info.pid, r.info.gpu_uuid, r.alive) for r in rt.read_reports()])

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"read_reports did not return within {seconds} s"
    return result[0]


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"[" * 8000, "not JSON"),  # deep nesting within the size cap: RecursionError, caught
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe", "not JSON"),
        (json.dumps({"t": 1, "pid": 1}).encode(), "is not the sender's pid"),
    ],
)
def test_malformed_reports_are_refused_in_one_line(
    runtime: RuntimeDir, honest: FakeRank, data: bytes, why: str, caplog: Any
) -> None:
    with caplog.at_level(logging.WARNING, "gpuwatch.reports"), connect(runtime) as sock:
        sock.send(data)
        assert sorted(read_within(runtime)) == [(honest.pid, "GPU-right", True)]
        read_within(runtime)

    (line,) = [r.getMessage() for r in caplog.records if str(os.getpid()) in r.getMessage()]
    assert why in line
    assert runtime.board.refused["invalid"] == 1


def test_a_report_over_the_size_bound_is_dropped_unread(runtime: RuntimeDir, honest: FakeRank) -> None:
    with connect(runtime) as sock:
        sock.send(body(job_id="x" * (MAX_REPORT_BYTES + 1)))
        assert read_within(runtime) == [(honest.pid, "GPU-right", True)]
    assert runtime.board.refused["too_large"] == 1


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"step_time_s": "abc"}, "step_time_s: expected a finite number"),
        ({"step": -1}, "step: expected an integer"),
        ({"step": True}, "step: expected an integer"),
        ({"rank": 2**40}, "rank: expected an integer"),
        ({"grad_norm": float("nan")}, "grad_norm: expected a finite number"),
        ({"step_t": -5}, "step_t: expected a finite number"),
        ({"job_id": "x" * 1000}, "job_id: expected printable text"),
        ({"job_id": "a\nb"}, "job_id: expected printable text"),
        ({"ended": "maybe"}, "ended: expected one of finished, resume, error"),
        ({"t": "now"}, "t: expected a finite number"),
    ],
)
def test_a_badly_typed_field_rejects_the_report(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ReportError, match=why):
        parse_report(json.dumps({"t": 1.0, "pid": 10, **fields}).encode(), 10)


def test_the_kernel_not_the_report_says_which_process_speaks(runtime: RuntimeDir, honest: FakeRank) -> None:
    """A report claiming the honest rank's pid, sent by another process, speaks for nobody."""
    with connect(runtime) as sock:
        sock.send(json.dumps({"t": time.time(), "pid": honest.pid, "gpu_uuid": "GPU-wrong"}).encode())
        assert read_within(runtime) == [(honest.pid, "GPU-right", True)]


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev_zero", "sparse_1gib", "socket"])
def test_a_passed_descriptor_that_is_no_step_page_is_closed_without_blocking(
    runtime: RuntimeDir, honest: FakeRank, tmp_path: Path, kind: str
) -> None:
    target = tmp_path / kind
    if kind == "fifo":
        os.mkfifo(target)
        fd = os.open(target, os.O_RDWR | os.O_NONBLOCK)
    elif kind == "directory":
        target.mkdir()
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    elif kind == "dev_zero":
        fd = os.open("/dev/zero", os.O_RDONLY)
    elif kind == "sparse_1gib":
        fd = os.open(target, os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, 1 << 30)
        os.pwrite(fd, b"\xff" * 64, 0)
    else:
        fd = socket.socket(socket.AF_UNIX).detach()
    with connect(runtime) as sock:
        send_with_fd(sock, body(step=7), fd)
        reports = {r.info.pid: r.info for r in runtime.read_reports()}
    os.close(fd)
    assert reports[os.getpid()].step == 7, "the report stands; only its page is refused"
    assert reports[honest.pid].step == 3


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_a_step_page_owned_by_another_user_is_not_taken(runtime: RuntimeDir, tmp_path: Path) -> None:
    page = tmp_path / "page"
    page.write_bytes(b"GWSTEP1\0" + (999).to_bytes(8, "little") * 2 + bytes(48))
    os.chown(page, STRANGER_UID, STRANGER_UID)
    fd = os.open(page, os.O_RDONLY)
    with connect(runtime) as sock:
        send_with_fd(sock, body(step=7), fd)
        (report,) = runtime.read_reports()
    os.close(fd)
    assert report.info.step == 7
    assert runtime.board.refused["invalid"] == 1


def test_a_flooding_connection_is_cut_off_and_the_others_still_report(runtime: RuntimeDir, honest: FakeRank) -> None:
    with connect(runtime) as sock:
        sock.setblocking(False)
        sent = 0
        for _ in range(FLOOD_DROPS + 400):
            try:
                sock.send(body(step=sent))
                sent += 1
            except BlockingIOError:
                runtime.read_reports()
            except OSError:
                break  # the daemon closed it
        runtime.read_reports()
        honest.report(runtime.path, t=time.time(), job_id="job", step=4, gpu_uuid="GPU-right")
        reports = {r.info.pid: r.info.step for r in runtime.read_reports()}
    assert reports[honest.pid] == 4
    assert runtime.board.refused["rate"] >= 1
    assert reports[os.getpid()] is not None and reports[os.getpid()] < 30, "only the burst was taken"


def test_one_user_over_its_bound_is_refused_and_only_that_user(
    runtime: RuntimeDir, honest: FakeRank, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(board_module, "MAX_RANKS_PER_UID", 2)
    ranks = [FakeRank() for _ in range(3)]  # honest is the first of this uid: these make four
    try:
        for rank in ranks:
            rank.report(runtime.path, t=time.time(), job_id="many", step=1)
        pids = {pid for pid, _, _ in read_within(runtime)}
        assert pids == {honest.pid, ranks[0].pid}
        assert runtime.board.refused["user_limit"] == 2
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


def test_a_gone_process_is_kept_a_while_then_dropped(tmp_path: Path) -> None:
    now = [0.0]
    board = ReportBoard(ProcFs(), clock=lambda: now[0])
    rank = FakeRank()
    assert board.admit(rank.pid, os.getuid())
    board.receive(rank.pid, json.dumps({"t": 1.0, "pid": rank.pid, "ended": None}).encode())
    rank.kill()
    rank.wait()

    (report,) = board.reports()
    assert (report.alive, report.running) == (False, False)
    now[0] += DEAD_KEEP_S + 1
    assert board.reports() == []


class _RecycledPids(ProcFs):
    """A /proc whose pid 4242 is one process, then another (a recycled pid)."""

    def __init__(self) -> None:
        super().__init__()
        self.start = 100

    def start_time(self, pid: int) -> int | None:
        return self.start

    def alive(self, pid: int, start_time: int | None) -> bool:
        return start_time == self.start

    def liveness(self, pid: int, start_time: int | None) -> bool | None:
        return self.alive(pid, start_time)


def test_a_recycled_pid_is_a_new_process_not_the_old_report() -> None:
    proc = _RecycledPids()
    board = ReportBoard(proc)
    assert board.admit(4242, 0)
    board.receive(4242, json.dumps({"t": 1.0, "pid": 4242, "job_id": "old"}).encode())
    proc.start = 200  # the old process is gone, a new one has its pid

    assert [(r.info.job_id, r.alive) for r in board.reports()] == [("old", False)]
    assert board.admit(4242, 1000)
    board.receive(4242, json.dumps({"t": 2.0, "pid": 4242, "job_id": "new"}).encode())
    assert [(r.info.job_id, r.owner_uid, r.alive) for r in board.reports()] == [("new", 1000, True)]


def test_prepare_on_a_read_only_place_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")

    with pytest.raises(ConfigError, match=r"^runtime_dir: cannot prepare .*file/run.*: Not a directory$"):
        RuntimeDir(blocker / "run").prepare()


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_a_runtime_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """Its owner could replace status.json or put a socket of their own in the daemon's place."""
    planted = tmp_path / "run"
    planted.mkdir()
    os.chown(planted, STRANGER_UID, STRANGER_UID)

    with pytest.raises(ConfigError, match=rf"^runtime_dir: cannot prepare .*: owned by uid {STRANGER_UID}"):
        RuntimeDir(planted).prepare()


def test_an_older_releases_report_dir_is_removed_and_a_link_in_it_is_never_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    old = tmp_path / "run" / "trainers"
    (old / "nested").mkdir(parents=True)
    (old / "4242.json").write_text("{}")
    (old / "nested" / "x.json").write_text("{}")
    (old / "escape").symlink_to(outside)  # what a user could plant in a 1777 directory

    rt = RuntimeDir(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="gpuwatch.runtime"):
        rt.prepare()
    rt.close()
    assert not os.path.lexists(old)
    assert (outside / "keep.txt").read_text() == "keep"
    (line,) = [r.getMessage() for r in caplog.records if "older gpuwatch" in r.getMessage()]
    assert f"removed {old} (2 report file(s))" in line and "trainers.sock" in line


def test_a_link_in_place_of_the_old_report_dir_is_unlinked_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trainers").symlink_to(outside)

    rt = RuntimeDir(tmp_path / "run")
    rt.prepare()
    rt.close()
    assert not os.path.lexists(tmp_path / "run" / "trainers")
    assert (outside / "keep.txt").read_text() == "keep"


def test_an_old_report_dir_that_cannot_be_removed_never_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "run" / "trainers").mkdir(parents=True)

    def refuse(path: object, *args: object, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))  # an immutable file, as root sees it

    monkeypatch.setattr(runtime_module.shutil, "rmtree", refuse)
    rt = RuntimeDir(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="gpuwatch.runtime"):
        rt.prepare()
    rt.close()
    assert rt.socket_path.exists(), "the daemon started and took reports"
    lines = [r.getMessage() for r in caplog.records]
    assert any("cannot remove" in line and "Operation not permitted" in line for line in lines), lines


def test_a_long_runtime_path_still_binds_and_takes_reports(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "run"
    rt = RuntimeDir(deep)
    rt.prepare()
    rank = FakeRank()
    try:
        rank.report(deep, t=time.time(), step=9)
        assert [(r.info.pid, r.info.step) for r in rt.read_reports()] == [(rank.pid, 9)]
    finally:
        rank.kill()
        rank.wait()
        rt.close()


@pytest.mark.parametrize(("greeting", "line"), [
    (None, f"speaks report protocol 1, this daemon {REPORT_PROTOCOL} (it sent no hello)"),
    (b'{"hello": "gpuwatch", "protocol": 99, "pid": PID}', f"report protocol 99, this daemon {REPORT_PROTOCOL}:"),
    (b'{"hello": "gpuwatch", "protocol": 2, "pid": PID}', None),
])  # fmt: skip
def test_the_daemon_greets_each_rank_and_names_one_that_speaks_another_version(
    runtime: RuntimeDir, greeting: bytes | None, line: str | None, caplog: Any
) -> None:
    with caplog.at_level(logging.WARNING, "gpuwatch.reports"), connect(runtime, greet=False) as sock:
        if greeting is not None:
            sock.send(greeting.replace(b"PID", str(os.getpid()).encode()))
        sock.send(body(step=7))
        runtime.read_reports()
        sock.settimeout(5)
        assert json.loads(sock.recv(256)) == {"hello": "gpuwatch", "protocol": REPORT_PROTOCOL}

    (report,) = runtime.read_reports()
    assert report.info.step == 7  # read as before, whatever version the rank speaks
    lines = [r.getMessage() for r in caplog.records if f"pid {os.getpid()}" in r.getMessage()]
    assert lines == ([] if line is None else [lines[0]]) and (line is None or line in lines[0]), lines


def _old_daemon(path: Path, greeting: bytes | None) -> tuple[socket.socket, threading.Thread]:
    """A report socket that reads every message and greets with `greeting` (None: as a daemon before the hello)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with socket_address(path) as address:
        listener.bind(address)
    listener.listen(4)

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            if greeting is not None:
                conn.send(greeting)
            while conn.recv(MAX_REPORT_BYTES + 1):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


@pytest.mark.parametrize(("greeting", "line"), [
    (None, f"speaks report protocol 1, this rank's gpuwatch {REPORT_PROTOCOL}"),
    (b'{"hello": "gpuwatch", "protocol": 3}', f"speaks report protocol 3, this rank's gpuwatch {REPORT_PROTOCOL}"),
    (b'{"hello": "gpuwatch", "protocol": 2}', None),
])  # fmt: skip
@pytest.mark.slow
def test_a_rank_says_once_when_the_daemon_speaks_another_version(
    tmp_path: Path, greeting: bytes | None, line: str | None, caplog: Any
) -> None:
    from gpuwatch.trainer.channel import ReportSender

    listener, _ = _old_daemon(tmp_path / "trainers.sock", greeting)
    sender = ReportSender(tmp_path / "trainers.sock", None)
    with caplog.at_level(logging.WARNING, "gpuwatch.trainer"), listener:
        for _ in range(5):
            assert sender.send(body(), final=True)
            time.sleep(0.05)
        sender.close()
    lines = [r.getMessage() for r in caplog.records if "report protocol" in r.getMessage()]
    assert len(lines) == (0 if line is None else 1) and (line is None or line in lines[0]), lines
    assert sender.daemon_protocol == (1 if greeting is None else json.loads(greeting)["protocol"])


def test_a_pause_on_the_step_page_reaches_the_daemon_before_any_report_says_so() -> None:
    """TrainerLink.pause writes the page first: the daemon's view has the pause with no new report."""
    board = ReportBoard(ProcFs())
    pid = os.getpid()
    page = StepPageWriter(pid)
    page.ints[STEP_SLOT] = 40
    assert board.admit(pid, os.getuid())
    board.receive(pid, json.dumps({"t": 1.0, "pid": pid, "step": 40, "pause": None}).encode(), os.dup(page.fd or -1))

    page.floats[PAUSE_UNTIL_SLOT] = 1_800_000_600.0
    (report,) = board.reports()
    assert (report.info.pause_until, report.info.pause) == (1_800_000_600.0, "a declared pause")

    board.receive(pid, json.dumps({"t": 2.0, "pid": pid, "pause": "eval", "pause_until": 1_800_000_600.0}).encode())
    (report,) = board.reports()
    assert (report.info.pause_until, report.info.pause, report.info.step) == (1_800_000_600.0, "eval", 40)
    board.close()
    page.close()


def test_a_daemon_out_of_descriptors_takes_no_live_rank_for_gone(tmp_path: Path) -> None:
    """/proc unreadable for EMFILE says nothing about the rank: it stays listed, alive, past DEAD_KEEP_S."""
    import resource

    now = [0.0]
    board = ReportBoard(ProcFs(), clock=lambda: now[0])
    pid = os.getpid()
    assert board.admit(pid, os.getuid())
    board.receive(pid, json.dumps({"t": 1.0, "pid": pid, "job_id": "live"}).encode())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with contextlib.suppress(OSError):
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        seen = []
        for _ in range(3):
            seen.append([(r.info.job_id, r.alive) for r in board.reports()])
            now[0] += DEAD_KEEP_S
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert seen == [[("live", True)]] * 3
    assert [(r.info.job_id, r.alive) for r in board.reports()] == [("live", True)]


def test_accept_failures_back_off_and_say_so_at_a_bounded_rate(
    runtime: RuntimeDir, caplog: pytest.LogCaptureFixture
) -> None:
    """EMFILE from accept() with the backlog full: the thread waits longer each time, and logs one line, not 500."""
    import errno

    from gpuwatch.reports.server import ACCEPT_BACKOFF_MAX_S

    server = runtime.server

    class Exhausted:
        def accept(self) -> None:
            raise OSError(errno.EMFILE, "Too many open files")

    real, server._listener = server._listener, Exhausted()  # type: ignore[assignment]
    pauses = []
    try:
        with caplog.at_level(logging.WARNING, logger="gpuwatch.reports"):
            for _ in range(500):
                server._accept_after = 0.0  # as if each pause had passed
                before = time.monotonic()
                server._accept()
                pauses.append(server._accept_after - before)
    finally:
        server._listener = real
    lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert pauses[0] >= 0.04 and ACCEPT_BACKOFF_MAX_S * 0.9 <= max(pauses) <= ACCEPT_BACKOFF_MAX_S + 0.1
