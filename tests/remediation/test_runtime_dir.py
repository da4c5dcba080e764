"""The runtime directory as an attacker or a bad day would fill it (issue 10, items 1-3).

Every case puts a hostile entry in trainers/ beside one honest report of a live process, and
asserts that the read returns (no hang, no exception), the honest report is still there, and the
hostile one is ignored with one log line.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.runtime import MAX_ENTRIES, Report, ReportError, RuntimeDir, parse_report
from gpuwatch.trainer.contract import MAX_REPORT_BYTES
from tests.helpers import start_sim_node

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

ROOT = os.geteuid() == 0
STRANGER_UID = 54_321  # a uid that runs nothing here: "another local user"


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def runtime(tmp_path: Path) -> RuntimeDir:
    rt = RuntimeDir(tmp_path / "run")
    rt.prepare()
    return rt


def write(rt: RuntimeDir, name: str, body: Any) -> Path:
    path = rt.trainers / name
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return path


def honest(rt: RuntimeDir, pid: int, **fields: Any) -> Path:
    return write(rt, f"{pid}.json", {"t": time.time(), "pid": pid, "job_id": "job", "step": 3, **fields})


def read_within(rt: RuntimeDir, seconds: float = 5.0) -> list[Report]:
    """read_reports in a thread: a read that blocks (a FIFO) fails the test instead of hanging it."""
    result: list[list[Report]] = []
    thread = threading.Thread(target=lambda: result.append(rt.read_reports()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"read_reports did not return within {seconds} s"
    return result[0]


def pids(reports: list[Report]) -> list[tuple[int, bool]]:
    return [(r.info.pid, r.alive) for r in reports]


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("fifo", lambda p: os.mkfifo(p)),
        ("symlink_to_dev_zero", lambda p: os.symlink("/dev/zero", p)),
        ("directory", lambda p: os.mkdir(p)),
        ("sparse_1gib", lambda p: os.truncate(p.open("wb").name, 1 << 30)),
    ],
)
def test_entries_that_are_no_small_regular_file_are_skipped_without_blocking(
    runtime: RuntimeDir, child: subprocess.Popen[bytes], name: str, make: Callable[[Path], None], caplog: Any
) -> None:
    honest(runtime, child.pid)
    make(runtime.trainers / "4242.json")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    with caplog.at_level(logging.WARNING, "gpuwatch.runtime"):
        reports = read_within(runtime)
        read_within(runtime)  # a second tick says nothing new

    assert pids(reports) == [(child.pid, True)]
    assert len([r for r in caplog.records if "4242.json" in r.getMessage()]) == 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024  # KiB: nothing big was read


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("[" * 60_000, "not JSON"),  # deep nesting within the size cap: RecursionError, caught
        ("{" * (MAX_REPORT_BYTES + 1), "bytes, more than"),
        ('{"pid": 1e30, "t": 1}', "pid: 1e+30 is not the file's pid"),
        ("[1, 2]", "not a JSON object"),
        ("\xff\xfe", "not JSON"),
    ],
)
def test_malformed_reports_are_one_line_each(
    runtime: RuntimeDir, child: subprocess.Popen[bytes], body: str, why: str, caplog: Any
) -> None:
    honest(runtime, child.pid)
    write(runtime, "777.json", body)

    with caplog.at_level(logging.WARNING, "gpuwatch.runtime"):
        assert pids(read_within(runtime)) == [(child.pid, True)]
        read_within(runtime)

    (line,) = [r.getMessage() for r in caplog.records if "777.json" in r.getMessage()]
    assert why in line


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"step_time_s": "abc"}, "step_time_s: expected a finite number"),
        ({"step": -1}, "step: expected an integer"),
        ({"step": True}, "step: expected an integer"),
        ({"rank": 2**40}, "rank: expected an integer"),
        ({"grad_norm": float("nan")}, "grad_norm: expected a finite number"),
        ({"job_id": "x" * 1000}, "job_id: expected printable text"),
        ({"job_id": "a\nb"}, "job_id: expected printable text"),
        ({"ended": "maybe"}, "ended: expected one of finished, resume, error"),
        ({"t": "now"}, "t: expected a finite number"),
    ],
)
def test_a_badly_typed_field_rejects_the_report(fields: dict[str, Any], why: str) -> None:
    body = {"t": 1.0, "pid": 10, **fields}
    with pytest.raises(ReportError, match=why):
        parse_report(json.dumps(body).encode(), 10)


def test_a_report_speaks_only_for_the_pid_of_its_file_name(runtime: RuntimeDir, child: subprocess.Popen[bytes]) -> None:
    """zzz.json (or 1.json) claiming the victim's pid and another GPU moves nothing."""
    honest(runtime, child.pid, gpu_uuid="GPU-right")
    write(runtime, "zzz.json", {"t": time.time(), "pid": child.pid, "gpu_uuid": "GPU-wrong"})
    write(runtime, "1.json", {"t": time.time(), "pid": child.pid, "gpu_uuid": "GPU-wrong"})

    reports = read_within(runtime)

    assert [(r.info.pid, r.info.gpu_uuid) for r in reports] == [(child.pid, "GPU-right")]


@pytest.mark.skipif(not ROOT, reason="chown to another user needs root")
def test_a_report_owned_by_another_user_is_not_attributed(runtime: RuntimeDir, child: subprocess.Popen[bytes]) -> None:
    """Another local user pre-creates `<victim pid>.json`: the daemon must not take its word for the victim."""
    path = honest(runtime, child.pid, gpu_uuid="GPU-wrong")
    os.chown(path, STRANGER_UID, STRANGER_UID)

    assert read_within(runtime) == []
    assert runtime.read_report(child.pid) is None


def test_a_report_older_than_its_process_is_a_gone_process(runtime: RuntimeDir, child: subprocess.Popen[bytes]) -> None:
    """A recycled pid: the file was written before the process that has the pid now started."""
    path = honest(runtime, child.pid)
    before_start = time.time() - 10  # the child started a moment ago
    os.utime(path, (before_start, before_start))

    (report,) = read_within(runtime)

    assert (report.info.pid, report.alive) == (child.pid, False)


def test_gone_processes_last_reports_are_kept_a_while_then_removed(runtime: RuntimeDir) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fresh = honest(runtime, gone.pid, ended=None)

    (report,) = read_within(runtime)
    assert (report.alive, report.running) == (False, False)

    old = time.time() - 3600
    os.utime(fresh, (old, old))
    assert read_within(runtime) == [] and not fresh.exists()


def test_junk_is_removed_once_old_and_a_flood_is_read_only_in_part(runtime: RuntimeDir, caplog: Any) -> None:
    junk = write(runtime, "notes.txt", "hello")
    old = time.time() - 3600
    os.utime(junk, (old, old))
    for i in range(MAX_ENTRIES + 10):
        write(runtime, f".tmp-{i}", "")

    with caplog.at_level(logging.WARNING, "gpuwatch.runtime"):
        read_within(runtime)
        read_within(runtime)

    assert [r.getMessage() for r in caplog.records].count(
        f"{runtime.trainers} holds more than {MAX_ENTRIES} entries: reading only the first"
    ) == 1


def test_prepare_on_a_read_only_place_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")

    with pytest.raises(ConfigError, match=r"^runtime_dir: cannot prepare .*file/run.*: Not a directory$"):
        RuntimeDir(blocker / "run").prepare()


def test_status_json_is_replaced_when_a_gpu_changes_and_refreshed_every_30_s(tmp_path: Path) -> None:
    """Ranks re-read status.json whenever it is replaced: an unchanged file is left alone between refreshes."""
    node = start_sim_node(tmp_path, "healthy", gpus=2)
    try:
        status = node.daemon.runtime.path / "status.json"

        def replaced() -> tuple[int, dict[str, Any]]:
            return status.stat().st_ino, json.loads(status.read_bytes())

        first, body = replaced()
        node.run_for(10)  # two samples, nothing changed
        assert replaced() == (first, body)
        node.daemon.monitor.quarantine(1, "bad fan")  # a change goes out at once
        second, body = replaced()
        assert second != first and body["gpus"][1]["quarantined"] is True
        node.run_for(20)
        assert replaced()[0] == second
        node.run_for(10)  # 30 s since the last write: `t` is refreshed although nothing changed
        third, refreshed = replaced()
        assert third != second and refreshed["t"] > body["t"] and refreshed["gpus"] == body["gpus"]
    finally:
        node.close()
