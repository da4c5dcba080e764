"""A small HTTP client for the running daemon (urllib), used by the CLI, `launch` and the drills.

Answers are parsed into the API's own models (gpuwatch.wire), imported at the first answer: the
daemon imports this client (its drills talk to it over HTTP) and must not load pydantic before its
own API is asked something, and `gpuwatch --help` should not pay for it either.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwatch.config import DEFAULT_CONFIG_PATH, Config, config_file
from gpuwatch.errors import DaemonError

if TYPE_CHECKING:
    from gpuwatch import wire


class DaemonClient:
    """Talks to the daemon at `config.listen`; reads the token from the state dir for POSTs."""

    def __init__(self, config: Config, timeout_s: float = 10.0, config_path: str | Path | None = None) -> None:
        host = config.listen_host
        if host in {"0.0.0.0", "::", "[::]"}:
            host = "127.0.0.1"
        self.base = f"http://{host}:{config.listen_port}"
        self.token_path = Path(config.token_path)
        self.timeout_s = timeout_s
        used = config_file(config_path)
        none = f"{DEFAULT_CONFIG_PATH} does not exist"
        if os.environ.get("GPUWATCH_CONFIG") == "":
            none = "GPUWATCH_CONFIG is empty"
        self.source = f"config {used}" if used else f"no config file: {none}"

    def _token(self) -> str:
        try:
            return self.token_path.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise DaemonError(
                f"cannot read the API token {self.token_path}: {exc.strerror or exc} ({self.source}); run as root "
                "(the token is 0600), or pass --state-dir with the daemon's state dir, or --config with its config file"
            ) from None

    def require_token(self) -> None:
        """Raise DaemonError (saying what to pass) now, before anything is done, when no token can be read."""
        self._token()

    def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if method != "GET":
            headers["Authorization"] = f"Bearer {self._token()}"
            headers["Content-Type"] = "application/json"
            data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise DaemonError(f"{method} {path}: HTTP {exc.code}: {_detail(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise DaemonError(
                f"cannot reach the gpuwatch daemon at {self.base}: {reason} ({self.source}); is it running? "
                "Pass --listen HOST:PORT, or --config with the daemon's config file"
            ) from None

    def gpus(self) -> list[wire.Gpu]:
        return self.gpu_list().gpus

    def gpu_list(self) -> wire.GpuList:
        """GET /v1/gpus whole: the GPUs and the findings on the node."""
        from gpuwatch import wire

        return wire.read(wire.GpuList, self.request("GET", "/v1/gpus"), "GET /v1/gpus")

    def injections(self) -> list[wire.Injection]:
        from gpuwatch import wire

        return wire.read(wire.Injections, self.request("GET", "/v1/injections"), "GET /v1/injections").injections

    def end_injection(self, injection_id: int) -> wire.Injection:
        """End a drill's injection now (DELETE); the answer's `until` is when it ended."""
        from gpuwatch import wire

        path = f"/v1/injections/{injection_id}"
        return wire.read(wire.Injection, self.request("DELETE", path), f"DELETE {path}")

    def quarantine(self, index: int, reason: str) -> wire.GpuChanged:
        from gpuwatch import wire

        path = f"/v1/gpus/{index}/quarantine"
        return wire.read(wire.GpuChanged, self.request("POST", path, {"reason": reason}), f"POST {path}")

    def release(
        self, index: int, reason: str = "operator", force: bool = False, validate_timeout_s: float | None = None
    ) -> wire.GpuChanged:
        """Release GPU `index`; a GPU still degraded or unhealthy needs `force` (HTTP 409 without it); with
        `validate_timeout_s`, only after the GPU test passes (waited for that long)."""
        from gpuwatch import wire

        path, body = f"/v1/gpus/{index}/release", {"reason": reason, "force": force}
        if validate_timeout_s is not None:
            body["validate"] = True
        return wire.read(wire.GpuChanged, self.request("POST", path, body, validate_timeout_s), f"POST {path}")


def _detail(body: bytes) -> str:
    """What an error answer says: its `detail`, a 422's bad parts one by one, or the body as it came."""
    from pydantic import ValidationError

    from gpuwatch import wire

    try:
        detail = wire.UnprocessableBody.model_validate_json(body).detail
    except ValidationError:
        return body.decode(errors="replace")
    if isinstance(detail, str):
        return detail
    return "; ".join(f"{'.'.join(str(part) for part in e.loc)}: {e.msg}" for e in detail)
