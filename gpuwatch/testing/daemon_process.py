"""A real `gpuwatch run` process (or another local server) on a free loopback port: started, waited for, stopped.

The tests, the tests/hardware scripts and the bench (gpuwatch.bench.daemons) start their daemons
here; it ships in the package because the bench needs it (gpuwatch cannot import tests/). Each daemon
gets its own root folder: `gpuwatch.toml` (the config it is given, written
there, so a node's /etc/gpuwatch/gpuwatch.toml never applies), `state/`, `run/` and `daemon.log`
(its stdout and stderr). It inherits this process's environment without GPUWATCH_* (the config
file, flags and `env` say everything).

    with DaemonProcess(tmp_path, "--sim-gpus", "2", "--interval", "1") as daemon:
        daemon.get("/v1/gpus")
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

ConfigTables = Mapping[str, Mapping[str, float | int | bool | str]]
Server = TypeVar("Server", bound="ServerProcess")

READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


def free_port() -> int:
    """A port the kernel says is free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = 20.0, poll_s: float = 0.1) -> float:
    """Seconds until `check()` holds, asked every `poll_s`; TimeoutError naming `what` after `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if check():
            return time.monotonic() - started
        time.sleep(poll_s)
    raise TimeoutError(f"not within {timeout_s:g} s: {what}")


def child_env(drop: Sequence[str] = ("GPUWATCH_",)) -> dict[str, str]:
    """This process's environment without the variables whose names start with one of `drop`, and with
    GPUWATCH_CONFIG empty: a child reads no config file but the one its flags name (never the node's own)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(tuple(drop))}, "GPUWATCH_CONFIG": ""}


def toml_text(tables: ConfigTables) -> str:
    """A TOML file of [section] tables of scalars (all a test or bench config needs)."""
    lines: list[str] = []
    for section, values in tables.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            text = str(value).lower() if isinstance(value, bool) else json.dumps(value)
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


class ServerProcess:
    """A server subprocess whose stdout and stderr go to a log file, ready once `ready_path` answers 2xx.

    Raises (from start):
        RuntimeError: it exited, or did not answer in `READY_TIMEOUT_S`; the message ends with the
            last `tail_lines` lines of its log.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        log_path: Path,
        *,
        ready_path: str = "/metrics",
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        tail_lines: int = 20,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.port = port
        self.host = host
        self.log_path = log_path
        self.ready_path = ready_path
        self.env = dict(child_env() if env is None else env)
        self.cwd = cwd
        self.tail_lines = tail_lines
        self.pass_fds: tuple[int, ...] = ()  # descriptors it inherits (a socket unit's, in the tests)
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        if self._process is None:
            raise RuntimeError(f"{self.name} was not started")
        return self._process

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self: Server) -> Server:
        """Start it and wait until it answers; on failure it is stopped and RuntimeError says why."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.cwd,
            pass_fds=self.pass_fds,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}: {self.log_tail()}")
            try:
                urllib.request.urlopen(self.url + self.ready_path, timeout=5).close()
                return
            except OSError:
                time.sleep(0.1)
        waited = f"did not answer {self.ready_path} within {READY_TIMEOUT_S:.0f} s"
        raise RuntimeError(f"{self.name} {waited}: {self.log_tail()}")

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; its exit code (None if never started). Safe to call twice."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return None if self._process is None else self._process.returncode

    def kill(self) -> int | None:
        """SIGKILL, reaped at once: gone with no shutdown work, its driver state freed before this returns."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        return self.stop()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int | None = None) -> str:
        """The last `lines` (default `tail_lines`) non-empty lines of its log, for an error message."""
        try:
            kept = [line for line in self.log_text().splitlines() if line.strip()]
        except OSError:
            return "(no log)"
        return "\n".join(kept[-(lines or self.tail_lines) :]).strip() or "(empty log)"

    def __enter__(self: Server) -> Server:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class DaemonProcess(ServerProcess):
    """`python -m gpuwatch run` with its own root folder, on `host` and a free port, ready when /healthz answers.

    Args:
        root: where its config, state dir, runtime dir and log go (made if missing).
        args: more `gpuwatch run` flags (--interval, --sim-gpus, ...).
        backend: its --backend.
        config: the tables of its config file (none: an empty file, the defaults).
        env: variables set for it on top of this process's environment without GPUWATCH_*.
    """

    def __init__(
        self,
        root: Path,
        *args: str,
        backend: str = "sim",
        host: str = "127.0.0.1",
        config: ConfigTables | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "gpuwatch run",
        cwd: Path | None = None,
        tail_lines: int = 20,
    ) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.runtime_dir = root / "run"
        self.config_path = root / "gpuwatch.toml"
        port = free_port()
        self.listen = f"{host}:{port}"
        root.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(toml_text(config or {}), encoding="utf-8")
        argv = [sys.executable, "-m", "gpuwatch", "run", "--config", str(self.config_path), "--backend", backend]
        argv += ["--listen", self.listen, "--state-dir", str(self.state_dir), "--runtime-dir", str(self.runtime_dir)]
        super().__init__(
            name,
            [*argv, *args],
            port,
            root / "daemon.log",
            ready_path="/healthz",
            host=host,
            env={**child_env(), **(env or {})},
            cwd=cwd,
            tail_lines=tail_lines,
        )

    @property
    def cli_args(self) -> list[str]:
        """The flags that point a gpuwatch command at this daemon and its token."""
        return ["--listen", self.listen, "--state-dir", str(self.state_dir)]

    @property
    def token(self) -> str:
        return (self.state_dir / "token").read_text(encoding="utf-8").strip()

    def command(self, *args: str) -> list[str]:
        """The argv of `gpuwatch ARGS` pointed at this daemon."""
        return [sys.executable, "-m", "gpuwatch", *args, *self.cli_args]

    def cli(self, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """Run `gpuwatch ARGS` against this daemon; its output captured."""
        return run_gpuwatch(*args, *self.cli_args, env=env)

    def get(self, path: str) -> Any:
        """GET `path` and parse its JSON (urllib raises on an HTTP error)."""
        return json.loads(self.text(path))

    def text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=15) as response:  # a loaded CI machine: not 5 s
            body: bytes = response.read()
        return body.decode()

    def trainer_reports(self) -> list[dict[str, Any]]:
        """Every report the daemon holds (GET /v1/trainers), ended and gone ranks' too; `t` is when it was sent."""
        reports = self.get("/v1/trainers")["reports"]
        return [{**r, "t": r.get("updated_t")} for r in reports]


def run_gpuwatch(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m gpuwatch ARGS` with no config file unless `env` names one; its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "gpuwatch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "GPUWATCH_CONFIG": "", **(env or {})},
        cwd=cwd,
        check=False,
    )


def last_json(text: str) -> Any:
    """The last line of `text` that is JSON, else all of it parsed, else None (a command's --json answer)."""
    for line in reversed(text.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    try:
        return json.loads(text)
    except ValueError:
        return None
