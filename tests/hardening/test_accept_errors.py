"""accept() failures are one line per interval, never a traceback per retry (issue 10 item 5)."""

from __future__ import annotations

import asyncio
import errno
import logging
import subprocess
import sys

import pytest

from gpuwatch.serving.httpserver import FD_RESERVE, AcceptErrorLog


def emfile_context() -> dict[str, object]:
    """What asyncio's selector loop passes when accept() fails for want of descriptors."""
    return {
        "message": "socket.accept() out of system resource",
        "exception": OSError(errno.EMFILE, "Too many open files"),
    }


def test_accept_errors_are_one_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    handler = AcceptErrorLog(interval_s=60.0, clock=lambda: now[0])
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(handler)
    try:
        with caplog.at_level(logging.DEBUG):
            for second in range(120):  # asyncio retries accept() once a second
                now[0] = float(second)
                loop.call_exception_handler(emfile_context())
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == "gpuwatch.http"]
    assert len(lines) == 2 and all(r.exc_info is None for r in lines)
    assert "Too many open files" in lines[0].getMessage() and "59 more" in lines[1].getMessage()
    assert not [r for r in caplog.records if r.name == "asyncio"], "no traceback from the default handler"


def test_other_loop_errors_still_reach_the_default_handler(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(AcceptErrorLog())
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            loop.call_exception_handler({"message": "something else", "exception": RuntimeError("boom")})
    finally:
        loop.close()
    assert any("something else" in r.getMessage() for r in caplog.records if r.name == "asyncio")


def test_connection_cap_fits_below_the_fd_limit() -> None:
    """Under a hard fd limit of 300 the cap shrinks to fit (one warning); a low soft limit is raised first."""
    probe = (
        "import logging, resource, sys\n"
        "logging.basicConfig(stream=sys.stdout, format='%(message)s')\n"
        "from gpuwatch.serving.httpserver import raise_fd_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 300))\n"
        "print(raise_fd_limit(1000), raise_fd_limit(50), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    warning, numbers = out.strip().splitlines()
    assert "capping connections at" in warning and "LimitNOFILE" in warning
    assert numbers.split() == [str(300 - FD_RESERVE), "50", "300"]
