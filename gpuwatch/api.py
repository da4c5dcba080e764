"""The local HTTP API (FastAPI): /metrics, /healthz, /v1/* and the status page.

Every handler reads the Snapshot the monitor last published; nothing here touches NVML.
POST endpoints change state and need the bearer token from `<state_dir>/token`.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from gpuwatch import __version__, statuspage
from gpuwatch.errors import ConfigError
from gpuwatch.metrics import MetricsRenderer
from gpuwatch.model import SAMPLE_FIELDS, GpuStatus, Snapshot, TrainerInfo
from gpuwatch.monitor import Monitor


def ensure_token(path: Path) -> str:
    """The API token, created 0600 on first start so only root (and the CLI run as root) can change state."""
    if path.exists():
        token = path.read_text(encoding="utf-8").strip()
        if token:
            return token
        path.unlink()  # an empty token (a crash mid-write) would let an empty bearer through
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(token + "\n")
    return token


class QuarantineBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=500)


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(default="operator", min_length=1, max_length=500)
    validate_first: bool = Field(default=False, alias="validate")  # run the GPU test; release only if it passes


class InjectBody(BaseModel):
    """A drill's injection: sample fields to override for `duration_s`, and/or one event."""

    model_config = ConfigDict(extra="forbid")
    fields: dict[str, int | float | str | None] = Field(default_factory=dict)
    duration_s: float = Field(default=60.0, gt=0, le=86400)
    event: Literal["xid", "ecc_dbe", "ecc_sbe"] | None = None
    xid: int | None = Field(default=None, ge=1, le=1000)


ASGIApp = Callable[[dict[str, Any], Callable[..., Any], Callable[..., Any]], Awaitable[None]]


def metrics_fast_path(app: ASGIApp, renderer: MetricsRenderer) -> ASGIApp:
    """Answer GET /metrics before FastAPI's routing, request and response objects.

    A scrape is the hot path (every Prometheus server, every 15 s, often several at once) and its
    body is cached bytes, so the framework's per-request work is most of its cost: serving the
    bytes straight from ASGI roughly halves the latency under concurrent scrapes.
    """
    headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
    not_allowed = [(b"allow", b"GET, HEAD"), (b"content-length", b"0")]

    async def asgi(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["path"] != "/metrics":
            await app(scope, receive, send)
            return
        if scope["method"] not in {"GET", "HEAD"}:
            await send({"type": "http.response.start", "status": 405, "headers": not_allowed})
            await send({"type": "http.response.body", "body": b""})
            return
        body = renderer.render()
        length = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers + length})
        await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})

    return asgi


def trainer_json(t: TrainerInfo) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(t).items() if v is not None}


def gpu_json(g: GpuStatus, now: float) -> dict[str, Any]:
    """The wire form of one GPU (GET /v1/gpus and the status page)."""
    sample = g.sample
    return {
        "index": g.index,
        "uuid": g.uuid,
        "name": g.static.name,
        "pci_bus_id": g.static.pci_bus_id,
        "state": g.state.value,
        "quarantined": g.quarantined,
        "quarantine_reason": g.quarantine_reason or None,
        "quarantined_since": g.quarantined_since,
        "epoch": g.epoch,
        "suggested_action": g.suggested_action.value,
        "findings": [f.as_dict() for f in g.findings],
        "drill_active": g.drill_active,
        "error": g.error.kind if g.error else None,
        "sample_age_s": round(now - sample.t, 3) if sample else None,
        "sample": {k: getattr(sample, k) for k in SAMPLE_FIELDS if k not in {"index", "uuid"}} if sample else None,
        "xids": {str(x): n for x, n in g.xid_counts},
        "kernel_xids": [{"t": e.t, "xid": e.xid, "line": e.detail} for e in g.kernel_xids],
        "trainers": [trainer_json(t) for t in g.trainers],
        "static": dataclasses.asdict(g.static),
    }


def create_app(
    monitor: Monitor,
    renderer: MetricsRenderer,
    token: str,
    *,
    clock: Callable[[], float],
    extra_routes: Callable[[FastAPI, Callable[..., None]], None] | None = None,
    gpu_views: Sequence[Callable[[int], dict[str, Any]]] = (),
) -> ASGIApp:
    """Build the app: /metrics straight from ASGI, everything else through FastAPI.

    `extra_routes(app, require_token)` lets later layers (drills, incidents) add routes; each of
    `gpu_views` adds fields to a GPU's JSON (remediation adds its ranks).
    """
    app = FastAPI(title="gpuwatch", version=__version__, docs_url=None, redoc_url=None)

    def require_token(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token (see <state_dir>/token)")

    def snapshot() -> Snapshot:
        return monitor.snapshot

    def gpu_body(g: GpuStatus, now: float) -> dict[str, Any]:
        body = gpu_json(g, now)
        for view in gpu_views:
            body.update(view(g.index))
        return body

    def gpu_or_404(index: int) -> GpuStatus:
        status = monitor.snapshot.gpu(index)
        if status is None:
            raise HTTPException(status_code=404, detail=f"no GPU with index {index}")
        return status

    @app.get("/", response_class=HTMLResponse)
    def status_page() -> HTMLResponse:
        return HTMLResponse(statuspage.render(snapshot(), clock(), socket.gethostname()))

    @app.get("/healthz")
    def healthz() -> JSONResponse:
        snap = snapshot()
        age = clock() - snap.t
        stale = snap.samples_total == 0 or age > 3 * monitor.config.interval_s
        body = {"status": "stale" if stale else "ok", "last_sample_age_s": round(age, 3), "gpus": len(snap.gpus)}
        return JSONResponse(body, status_code=503 if stale else 200)

    @app.get("/v1/gpus")
    def gpus() -> dict[str, Any]:
        snap = snapshot()
        now = clock()
        return {"t": snap.t, "backend": snap.backend, "gpus": [gpu_body(g, now) for g in snap.gpus]}

    @app.get("/v1/gpus/{index}")
    def gpu(index: int) -> dict[str, Any]:
        return gpu_body(gpu_or_404(index), clock())

    @app.get("/v1/findings")
    def findings(limit: int = 200, gpu: int | None = None) -> dict[str, Any]:
        active = [f.as_dict() for g in snapshot().gpus for f in g.findings if gpu is None or g.index == gpu]
        history = monitor.store.findings(limit=max(1, min(limit, 5000)), gpu=gpu) if monitor.store else []
        return {"active": active, "history": history}

    @app.post("/v1/gpus/{index}/quarantine", dependencies=[Depends(require_token)])
    def quarantine(index: int, body: QuarantineBody) -> dict[str, Any]:
        gpu_or_404(index)
        return gpu_json(monitor.quarantine(index, body.reason), clock())

    @app.post("/v1/gpus/{index}/release", dependencies=[Depends(require_token)])
    def release(index: int, body: ReleaseBody) -> dict[str, Any]:
        gpu_or_404(index)
        if not body.validate_first:
            return gpu_json(monitor.release(index, body.reason), clock())
        status, result = monitor.release_validated(index, body.reason)  # blocks for the GPU test (threadpool)
        if not result.passed:
            raise HTTPException(409, f"GPU {index} stays quarantined: validation {result.outcome}: {result.reason}")
        return {**gpu_json(status, clock()), "validation": {"outcome": result.outcome, "reason": result.reason}}

    @app.post("/v1/gpus/{index}/inject", dependencies=[Depends(require_token)])
    def inject(index: int, body: InjectBody) -> dict[str, Any]:
        gpu_or_404(index)
        if not body.fields and body.event is None:
            raise HTTPException(status_code=422, detail="inject needs fields to override or an event")
        if body.event == "xid" and body.xid is None:
            raise HTTPException(status_code=422, detail="an xid event needs `xid`")
        try:
            injection = monitor.inject(index, body.fields, body.duration_s, body.event, body.xid)
        except ConfigError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        return injection.as_dict()

    @app.get("/v1/injections")
    def injections() -> dict[str, Any]:
        return {"injections": [i.as_dict() for i in monitor.injections()]}

    if extra_routes is not None:
        extra_routes(app, require_token)
    return metrics_fast_path(app, renderer)
