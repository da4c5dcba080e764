"""Nobody can stand in for the daemon: not on its port while it is down, not with a planted control socket.

Tried before as a hostile local user: whenever the daemon was not bound (a restart took 2.4 s to
lose the port), `mallory` bound 127.0.0.1:9835; root's `gpuwatch quarantine` then sent her the
token, `check --slurm` resumed a node gpuwatch had drained on her "all healthy", and `launch` took
her GPU list. Now the control plane goes over the control socket, which the client believes only
when root made it and root listens on it (SO_PEERCRED), and the TCP port is held by the socket unit
between runs. A throwaway user plays mallory (root only; skipped otherwise).
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.config import Config
from gpuwatch.control.hosts import HostPolicy
from gpuwatch.testing.daemon_process import DaemonProcess, child_env, run_gpuwatch, wait_until
from tests.hardening.conftest import local_users
from tests.helpers import REPO, fake_scontrol

pytestmark = pytest.mark.slow
SIM = ("--sim-scenario", "healthy", "--sim-gpus", "4", "--interval", "1")


@pytest.fixture(scope="module")
def mallory() -> Iterator[pwd.struct_passwd]:
    """A throwaway local user, removed afterwards."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a throwaway user")
    with local_users(f"gwmal{os.getpid() % 100000}") as (user,):
        yield user


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory every user may enter (pytest's own are root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="gpuwatch-impostor-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def open_to_others(path: str) -> bool:
    """Whether a user other than root can run `path`: every directory on the way searchable, the file executable."""
    real = Path(os.path.realpath(path))
    return all(os.stat(p).st_mode & 0o001 for p in [real, *real.parents])


def user_python() -> str:
    """A Python of this version that a throwaway user may run (a venv's may live under root's 0700 home)."""
    for candidate in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        if os.path.exists(candidate) and open_to_others(candidate):
            return candidate
    pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that other users may run")


def user_env() -> dict[str, str]:
    """This checkout and the packages of this test's Python, for a process of a throwaway user."""
    paths = [str(REPO), *(p for p in sys.path if p.endswith("site-packages"))]
    return {**child_env(), "PYTHONPATH": os.pathsep.join(paths), "GPUWATCH_CONFIG": "", "HOME": "/"}


def as_user(
    user: pwd.struct_passwd, argv: list[str], groups: tuple[int, ...] = (), **kwargs: Any
) -> subprocess.Popen[bytes]:
    """`argv` (a Python program: argv[0] is replaced by user_python()) as `user`, with only `groups` besides its own."""
    argv = [user_python(), *argv[1:]]
    return subprocess.Popen(
        argv, user=user.pw_uid, group=user.pw_gid, extra_groups=list(groups), env=user_env(), cwd=REPO, **kwargs
    )


@contextlib.contextmanager
def impostor(user: pwd.struct_passwd | None, files: Path, *where: str) -> Iterator[Path]:
    """tests/impostor.py as `user` (None: root), listening where `where` says; yields its request log."""
    files.mkdir()
    if user is not None:
        os.chown(files, user.pw_uid, user.pw_gid)
    log, ready = files / "requests.log", files / "ready"
    argv = [sys.executable, "-m", "tests.impostor", "--log", str(log), "--ready", str(ready), *where]
    switch = "--user" in where  # started as root, listens as the user: it writes its files after switching
    if user is None or switch:
        process = subprocess.Popen(argv, env={**child_env(), "PYTHONPATH": str(REPO)}, cwd=REPO)
    else:
        process = as_user(user, argv)
    try:
        wait_until("the impostor listens", ready.exists, timeout_s=20)
        yield log
    finally:
        process.terminate()
        process.wait(timeout=10)


def requests_seen(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def one_line(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_an_impostor_on_the_port_gets_no_token_no_resume_and_no_gpu_list(
    tmp_path: Path, shared: Path, mallory: pwd.struct_passwd
) -> None:
    root = tmp_path / "daemon"
    with DaemonProcess(root, *SIM) as daemon:
        assert daemon.cli("quarantine", "1", "--reason", "bad fan").returncode == 0
        port, cli_args, token = daemon.port, daemon.cli_args, daemon.token
    scontrol, node_file = fake_scontrol(tmp_path)
    node_file.write_text("NodeName=n\n   State=IDLE+DRAIN\n   Reason=gpuwatch: GPU 1 GPU-x bad fan [root@now]\n")
    slurm = {"GPUWATCH_SLURM_SCONTROL": scontrol, "GPUWATCH_SLURM_NODE_NAME": "n"}
    with impostor(mallory, shared / "impostor", "--tcp", str(port)) as log:
        for args in (["quarantine", "2", "--reason", "x"], ["release", "1", "--force"],
                     ["drill", "--inject", "gpu=2,preset=xid79", "--yes"]):  # fmt: skip
            line = one_line(run_gpuwatch(*args, *cli_args))
            assert "cannot reach the gpuwatch daemon: no control socket at" in line, line
        check = run_gpuwatch("check", "--slurm", "--samples", "1", *SIM[:4], "--backend", "sim", *cli_args, env=slurm)
        assert "sampling the GPUs itself" in check.stderr and "slurm: node n unchanged" in check.stdout, check
        assert node_file.exists(), "check --slurm resumed the node on an unauthenticated answer"
        launched = run_gpuwatch("launch", *cli_args, "--", "train.py")
        assert "gpuwatch launch: error: cannot reach the gpuwatch daemon: no control socket" in launched.stderr
        assert requests_seen(log) == [], "no command that sends or acts asked the impostor anything"

        shown = run_gpuwatch("status", *cli_args)  # shows, decides nothing: may read TCP, and says so
        assert "GPU-fake-0" in shown.stdout and "no control socket at" in shown.stderr, shown
        seen = requests_seen(log)
        assert [(r["method"], r["path"]) for r in seen] == [("GET", "/v1/gpus")]
        assert not any(token in json.dumps(r) for r in seen) and "Authorization" not in seen[0]["headers"]

        blocked = run_gpuwatch("run", "--backend", "sim", *SIM, *cli_args, "--runtime-dir", str(root / "run"))
        assert blocked.returncode == 2 and "Traceback" not in blocked.stderr, blocked.stderr
        line = blocked.stderr.strip().splitlines()[-1]  # after its start-up log: it cannot bind (no gpuwatch.socket)
        assert line == (
            f"gpuwatch: error: listen 127.0.0.1:{port}: Address already in use "
            "(under systemd, gpuwatch.socket holds the port between runs)"
        )


def planted_dir(shared: Path, owner: pwd.struct_passwd | None, mode: int) -> Path:
    state = shared / f"state-{mode:o}-{owner.pw_name if owner else 'root'}"
    state.mkdir()
    state.chmod(mode)
    if owner is not None:
        os.chown(state, owner.pw_uid, owner.pw_gid)
    return state


@pytest.mark.parametrize(
    ("where", "said"),
    [
        ("mallory's directory", "belongs to uid {uid}, not root: refusing it, it is not the daemon's"),
        ("a sticky directory", "belongs to uid {uid}, not root: refusing it, it is not the daemon's"),
        ("an open directory", "is a directory others may write to"),
        ("root's file, mallory listening", "is served by uid {uid} (pid "),
    ],
)
def test_a_planted_control_socket_is_refused_before_anything_is_sent(
    shared: Path, mallory: pwd.struct_passwd, where: str, said: str
) -> None:
    if where == "mallory's directory":
        state, user, extra = planted_dir(shared, mallory, 0o755), mallory, []
    elif where == "a sticky directory":
        state, user, extra = planted_dir(shared, None, 0o1777), mallory, []
    elif where == "an open directory":
        state, user, extra = planted_dir(shared, None, 0o777), None, []  # even a socket root made: anyone could swap it
    else:
        state, user, extra = planted_dir(shared, None, 0o755), None, ["--user", f"{mallory.pw_uid}:{mallory.pw_gid}"]
    owner = mallory if user is not None or extra else None
    with impostor(owner, shared / f"{state.name}-impostor", "--unix", str(state / "api.sock"), *extra) as log:
        for args in (["quarantine", "2", "--reason", "x"], ["status"]):
            line = one_line(run_gpuwatch(*args, "--state-dir", str(state), "--listen", "127.0.0.1:1"))
            assert said.format(uid=mallory.pw_uid) in line, line
        assert requests_seen(log) == []


def socket_unit(root: Path, port: int) -> tuple[socket.socket, socket.socket]:
    """What gpuwatch.socket makes, made here: a listening TCP socket and the control socket, both root's."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("127.0.0.1", port))
    tcp.listen(128)
    state = root / "state"
    state.mkdir(parents=True, exist_ok=True)
    state.chmod(0o755)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.bind(str(state / "api.sock"))
    os.chmod(state / "api.sock", 0o666)
    control.listen(128)
    return tcp, control


# What systemd does between fork and exec: the sockets become fds 3 and 4, LISTEN_PID is the service's pid.
SD_EXEC = """
import fcntl, os, sys
passed = [int(fd) for fd in sys.argv[1:3]]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in passed]
for fd in passed:
    os.close(fd)
for target, fd in zip((3, 4), high):
    os.dup2(fd, target)
    os.close(fd)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="2")
os.execv(sys.argv[3], sys.argv[3:])
"""


def activated(root: Path, sockets: tuple[socket.socket, socket.socket], *args: str, name: str) -> DaemonProcess:
    """The daemon started as systemd starts a socket-activated service: the sockets as fds 3 and 4, LISTEN_*."""
    daemon = DaemonProcess(root, *SIM, *args, name=name)
    port = sockets[0].getsockname()[1]
    daemon.listen, daemon.port = f"127.0.0.1:{port}", port
    daemon.argv[daemon.argv.index("--listen") + 1] = daemon.listen
    fds = [s.fileno() for s in sockets]
    daemon.argv = [sys.executable, "-c", SD_EXEC, *map(str, fds), *daemon.argv]
    daemon.pass_fds = tuple(fds)
    return daemon


def can_bind(user: pwd.struct_passwd, port: int) -> bool:
    probe = f"import socket; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()"
    return as_user(user, [sys.executable, "-c", probe], stderr=subprocess.DEVNULL).wait(timeout=20) == 0


def test_socket_activation_keeps_the_port_and_the_control_socket_across_a_restart(
    shared: Path, mallory: pwd.struct_passwd
) -> None:
    root = shared / "node"
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    sockets = socket_unit(root, port)
    first = activated(root, sockets, name="first run").start()
    try:
        assert "listening on the sockets gpuwatch.socket holds" in first.log_text()
        assert first.cli("quarantine", "1", "--reason", "via the passed control socket").returncode == 0
        assert not can_bind(mallory, port)
    finally:
        assert first.stop() == 0
    assert (root / "state" / "api.sock").exists(), "the daemon never removes the socket unit's socket"
    assert not can_bind(mallory, port), "between two runs the port stays held"
    waiting = subprocess.Popen(
        first.command("quarantine", "2", "--reason", "asked while the daemon was down"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "GPUWATCH_CONFIG": ""},
    )  # fmt: skip
    time.sleep(1.0)
    second = activated(root, sockets, name="second run").start()
    try:
        out, err = waiting.communicate(timeout=30)
        assert waiting.returncode == 0 and "GPU 2 quarantined" in out, err  # it queued, and the daemon answered it
        assert [g["quarantined"] for g in second.get("/v1/gpus")["gpus"]] == [False, True, True, False]
    finally:
        second.stop()
        for sock in sockets:
            sock.close()


def test_a_socket_unit_that_listens_elsewhere_than_the_config_is_one_line(shared: Path) -> None:
    root = shared / "node"
    sockets = socket_unit(root, 0)
    daemon = activated(root, sockets, name="mismatched")
    wanted = 1 + sockets[0].getsockname()[1] % 60000
    daemon.argv[daemon.argv.index("--listen") + 1] = f"127.0.0.1:{wanted}"
    try:
        with pytest.raises(RuntimeError, match="exited with code 2"):
            daemon.start()
        (line,) = [entry for entry in daemon.log_text().splitlines() if "error" in entry]
        assert line == (
            f"gpuwatch: error: listen 127.0.0.1:{wanted}: gpuwatch.socket listens on 127.0.0.1:"
            f"{sockets[0].getsockname()[1]} instead; make its ListenStream= and `listen` the same"
        )
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate not installed")
def test_systemds_own_socket_activation_starts_the_daemon_on_its_sockets(shared: Path) -> None:
    """systemd-socket-activate (systemd's tool for this protocol) binds both, then runs the daemon on them."""
    root = shared / "node"
    (root / "state").mkdir(parents=True)
    daemon = DaemonProcess(root, *SIM, name="systemd-socket-activate")
    control = root / "state" / "api.sock"
    daemon.argv = ["systemd-socket-activate", "-l", daemon.listen, "-l", str(control), *daemon.argv]
    with daemon:
        assert "listening on the sockets gpuwatch.socket holds" in daemon.log_text()
        assert daemon.cli("quarantine", "3", "--reason", "activated").returncode == 0
        assert daemon.get("/v1/gpus/3")["quarantined"]


def test_who_may_change_state_over_the_control_socket(shared: Path, mallory: pwd.struct_passwd) -> None:
    root = shared / "node"
    (root / "state").mkdir(parents=True)
    (root / "state").chmod(0o755)
    group = f"gwops{os.getpid() % 100000}"
    subprocess.run(["groupadd", "--system", group], check=True)
    try:
        with DaemonProcess(root, *SIM, env={"GPUWATCH_API_ADMIN_GROUP": group}) as daemon:
            mine = [sys.executable, "-m", "gpuwatch", *daemon.cli_args]
            shown = as_user(mallory, [*mine[:3], "status", *mine[3:]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = shown.communicate(timeout=60)
            assert shown.returncode == 0 and b"GPU 0" in out and b"no control socket" not in err, err
            refused = as_user(mallory, [*mine[:3], "quarantine", "1", "--reason", "x", *mine[3:]],
                              stderr=subprocess.PIPE)  # fmt: skip
            _, err = refused.communicate(timeout=60)
            assert refused.returncode == 2 and f"HTTP 403: uid {mallory.pw_uid} may not change state".encode() in err
            assert not daemon.get("/v1/gpus/1")["quarantined"]

            subprocess.run(["usermod", "-a", "-G", group, mallory.pw_name], check=True)
            allowed = as_user(mallory, [*mine[:3], "quarantine", "1", "--reason", "by the operators' group", *mine[3:]],
                              groups=(grp.getgrnam(group).gr_gid,), stderr=subprocess.PIPE)  # fmt: skip
            _, err = allowed.communicate(timeout=60)
            assert allowed.returncode == 0, err
            assert daemon.get("/v1/gpus/1")["quarantine_reason"] == "by the operators' group"
    finally:
        subprocess.run(["gpasswd", "-d", mallory.pw_name, group], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False, capture_output=True)


def http_status(url: str, host: str | None) -> int:
    request = urllib.request.Request(url)
    if host is not None:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def raw_status(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        return sock.recv(65536).split(b"\r\n", 1)[0]


def test_the_tcp_listener_answers_only_host_names_it_is_known_by(tmp_path: Path) -> None:
    env = {"GPUWATCH_API_ALLOWED_HOSTS": "gpu-node-7.example.org"}
    with DaemonProcess(tmp_path, *SIM, env=env) as daemon:
        url = daemon.url + "/v1/gpus"
        for host in (None, f"127.0.0.1:{daemon.port}", "localhost", f"[::1]:{daemon.port}", socket.gethostname(),
                     "GPU-NODE-7.example.org.", "10.0.0.5:9835"):  # fmt: skip
            assert http_status(url, host) == 200, host
        for host in ("attacker.example", f"attacker.example:{daemon.port}", "127.0.0.1.nip.io", "gpu-node-7"):
            assert http_status(url, host) == 421, host
            assert http_status(daemon.url + "/metrics", host) == 421, host
        assert raw_status(daemon.port, b"GET /v1/gpus HTTP/1.0\r\n\r\n") == b"HTTP/1.1 400 Bad Request"
        over_socket = run_gpuwatch("status", "--json", *daemon.cli_args)
        assert over_socket.returncode == 0 and "no control socket" not in over_socket.stderr


def test_host_policy() -> None:
    policy = HostPolicy(["node7", Config().listen_host])
    assert all(policy.allows(h) for h in ("localhost:1", "NODE7", "node7.", "127.0.0.1", "[::1]:80", "x.localhost"))
    assert not any(policy.allows(h) for h in ("", "node7:http", "evil.example", "[::1", "node7.evil.example"))
    assert HostPolicy(["*"]).allows("anything.example")


def test_sd_listen_fds_takes_only_what_is_meant_for_this_process() -> None:
    from gpuwatch.base.systemd import listen_fds

    other = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}
    assert listen_fds(other) == [] and other == {}, "a parent's sockets are not ours; the variables go either way"
    first, second = socket.socketpair()
    try:
        with contextlib.ExitStack() as stack:
            for fd, sock in ((3, first), (4, second)):
                saved = os.dup(fd) if _is_open(fd) else None
                os.dup2(sock.fileno(), fd)
                stack.callback(_restore, fd, saved)
            env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "2"}
            got = listen_fds(env)
            assert [s.fileno() for s in got] == [3, 4] and env == {}
            assert not any(os.get_inheritable(fd) for fd in (3, 4)), "the daemon's children never get them"
            for sock in got:
                sock.detach()
    finally:
        first.close()
        second.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _restore(fd: int, saved: int | None) -> None:
    if saved is None:
        os.close(fd)
    else:
        os.dup2(saved, fd)
        os.close(saved)
