"""A small HTTP client for the running daemon, used by the CLI, `launch` and the drills.

It talks over the daemon's control socket (`<state_dir>/api.sock`, gpuwatch.control): before a
byte is sent, the kernel says that root (or the caller itself) listens there, so the GPU lists
`launch` and `check --slurm` act on are the daemon's, and a state change is authorized by who the
caller is (root, or `api.admin_group`), never by a token a stand-in on the TCP port could keep.
Only `gpuwatch status`, which shows and decides nothing, may fall back to the TCP listener.

Answers are parsed into the API's own models (gpuwatch.serving.wire), imported at the first answer: the
daemon imports this client (its drills talk to it) and must not load pydantic before its own API
is asked something, and `gpuwatch --help` should not pay for it either.
"""

from __future__ import annotations

import grp
import http.client
import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatch.config import DEFAULT_CONFIG_PATH, Config, config_file
from gpuwatch.control.connect import ControlConnection, connect
from gpuwatch.control.socket_path import NoControlSocket, NotTheDaemon
from gpuwatch.errors import DaemonError

if TYPE_CHECKING:
    from gpuwatch.serving import wire


class DaemonClient:
    """Talks to the daemon over `config.control_socket`; `over_tcp`: GETs may fall back to `config.listen`."""

    def __init__(
        self, config: Config, timeout_s: float = 10.0, config_path: str | Path | None = None, over_tcp: bool = False
    ) -> None:
        host = config.listen_host
        if host in {"0.0.0.0", "::", "[::]"}:
            host = "127.0.0.1"
        self.base = f"http://{host}:{config.listen_port}"
        self.socket_path = config.control_socket
        self.admin_group = config.api.admin_group
        self.timeout_s = timeout_s
        self.over_tcp = over_tcp
        self.answered_over_tcp = False  # set when an answer came from the TCP listener, which nobody vouches for
        used = config_file(config_path)
        none = f"{DEFAULT_CONFIG_PATH} does not exist"
        if os.environ.get("GPUWATCH_CONFIG") == "":
            none = "GPUWATCH_CONFIG is empty"
        self.source = f"config {used}" if used else f"no config file: {none}"

    def require_control(self) -> None:
        """Raise DaemonError (saying what to do) now, before anything is done, when this caller may not change
        the daemon's state: the daemon must answer on its control socket, and the caller be root, the daemon's
        user or a member of api.admin_group (the daemon checks it again, on the kernel's word)."""
        sock, server = self._connect(self.timeout_s)
        sock.close()
        uid = os.geteuid()
        if uid in (0, server.uid) or self._in_admin_group():
            return
        group = f" or a member of api.admin_group {self.admin_group!r}" if self.admin_group else ""
        raise DaemonError(f"uid {uid} may not change the daemon's state: run it as root{group}")

    def _in_admin_group(self) -> bool:
        if not self.admin_group:
            return False
        try:
            return grp.getgrnam(self.admin_group).gr_gid in os.getgroups()
        except KeyError:
            return False

    def _connect(self, timeout_s: float) -> Any:
        try:
            return connect(self.socket_path, timeout_s)
        except (NoControlSocket, NotTheDaemon) as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: DaemonError) -> DaemonError:
        if isinstance(exc, NotTheDaemon):
            return DaemonError(f"{exc} ({self.source})")
        return DaemonError(
            f"cannot reach the gpuwatch daemon: {exc} ({self.source}); is it running? "
            "Pass --state-dir with the daemon's state dir, or --config with its config file"
        )

    def fetch(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> bytes:
        """The body of the daemon's answer to `method path`; DaemonError, one line, for an HTTP error or no daemon."""
        headers = {"Accept": "application/json"}
        data = None
        if method != "GET":
            headers["Content-Type"] = "application/json"
            data = json.dumps(body or {}).encode()
        connection = ControlConnection(self.socket_path, timeout_s or self.timeout_s)
        try:
            connection.request(method, path, body=data, headers=headers)
            response = connection.getresponse()
            raw = response.read()
        except NoControlSocket as exc:
            if self.over_tcp and method == "GET":
                return self._fetch_over_tcp(path, timeout_s)
            raise self._unreachable(exc) from None
        except NotTheDaemon as exc:
            raise self._unreachable(exc) from None
        except (OSError, http.client.HTTPException) as exc:
            raise DaemonError(f"{method} {path}: {getattr(exc, 'strerror', None) or exc}") from None
        finally:
            connection.close()
        if response.status >= 400:
            raise DaemonError(f"{method} {path}: HTTP {response.status}: {_detail(raw)}")
        return raw

    def _fetch_over_tcp(self, path: str, timeout_s: float | None) -> bytes:
        """GET `path` from the TCP listener: for what is only shown, when no control socket is there."""
        request = urllib.request.Request(self.base + path, headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s or self.timeout_s) as response:
                raw: bytes = response.read()
        except urllib.error.HTTPError as exc:
            raise DaemonError(f"GET {path}: HTTP {exc.code}: {_detail(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DaemonError(
                f"cannot reach the gpuwatch daemon at {self.base}: {reason} ({self.source}); is it running? "
                "Pass --listen HOST:PORT, or --config with the daemon's config file"
            ) from None
        self.answered_over_tcp = True
        return raw

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        return json.loads(self.fetch(method, path, body, timeout_s))

    def gpus(self) -> list[wire.Gpu]:
        return self.gpu_list().gpus

    def gpu_list(self) -> wire.GpuList:
        """GET /v1/gpus whole: the GPUs and the findings on the node."""
        from gpuwatch.serving import wire

        return wire.read(wire.GpuList, self.request("GET", "/v1/gpus"), "GET /v1/gpus")

    def daemon_info(self) -> wire.DaemonInfo:
        """GET /v1/daemon: the daemon's version, state dir, runtime dir and stop grace."""
        from gpuwatch.serving import wire

        return wire.read(wire.DaemonInfo, self.request("GET", "/v1/daemon"), "GET /v1/daemon")

    def injections(self) -> list[wire.Injection]:
        from gpuwatch.serving import wire

        return wire.read(wire.Injections, self.request("GET", "/v1/injections"), "GET /v1/injections").injections

    def end_injection(self, injection_id: int) -> wire.Injection:
        """End a drill's injection now (DELETE); the answer's `until` is when it ended."""
        from gpuwatch.serving import wire

        path = f"/v1/injections/{injection_id}"
        return wire.read(wire.Injection, self.request("DELETE", path), f"DELETE {path}")

    def quarantine(self, index: int, reason: str) -> wire.GpuChanged:
        from gpuwatch.serving import wire

        path = f"/v1/gpus/{index}/quarantine"
        return wire.read(wire.GpuChanged, self.request("POST", path, {"reason": reason}), f"POST {path}")

    def release(
        self, index: int, reason: str = "operator", force: bool = False, validate_timeout_s: float | None = None
    ) -> wire.GpuChanged:
        """Release GPU `index`; a GPU still degraded or unhealthy needs `force` (HTTP 409 without it); with
        `validate_timeout_s`, only after the GPU test passes (waited for that long)."""
        from gpuwatch.serving import wire

        path, body = f"/v1/gpus/{index}/release", {"reason": reason, "force": force}
        if validate_timeout_s is not None:
            body["validate"] = True
        return wire.read(wire.GpuChanged, self.request("POST", path, body, validate_timeout_s), f"POST {path}")


def _detail(body: bytes) -> str:
    """What an error answer says: its `detail`, a 422's bad parts one by one, or the body as it came."""
    from pydantic import ValidationError

    from gpuwatch.serving import wire

    try:
        detail = wire.UnprocessableBody.model_validate_json(body).detail
    except ValidationError:
        return body.decode(errors="replace")
    if isinstance(detail, str):
        return detail
    return "; ".join(f"{'.'.join(str(part) for part in e.loc)}: {e.msg}" for e in detail)
