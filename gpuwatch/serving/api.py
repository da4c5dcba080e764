"""The local HTTP API (FastAPI): /v1/*, the status page and /healthz's schema.

httpserver.front answers /metrics and /healthz before this app, which it builds at the first other request.

Every handler reads the Snapshot the monitor last published; nothing here touches NVML.
POST endpoints change state. On the control socket they are authorized by who calls, as the kernel
says (control.access: root, the daemon's user, api.admin_group); anywhere else, and for any other
caller, they need the bearer token from `<state_dir>/token`.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import socket
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse

from gpuwatch import __version__
from gpuwatch.control.access import Access
from gpuwatch.errors import ConfigError
from gpuwatch.model import SAMPLE_FIELDS, GpuStatus, Snapshot
from gpuwatch.node.monitor import Monitor
from gpuwatch.serving import liveness, statuspage, wire
from gpuwatch.serving.httpserver import peer
from gpuwatch.serving.operator_actions import quarantine_outcome, release_outcome, release_refusal
from gpuwatch.serving.viewer import sees, viewer_uid

log = logging.getLogger("gpuwatch.api")

B = TypeVar("B", bound=wire.GpuBase)


def _error(description: str) -> dict[str, Any]:
    return {"model": wire.ErrorBody, "description": description}


Responses = dict[int | str, dict[str, Any]]
NOT_FOUND: Responses = {404: _error("no GPU with that index")}
# What every route behind the token may answer besides its own result.
GUARDED: Responses = {
    401: _error("missing or wrong bearer token"),
    403: _error("on the control socket: the caller may not change state, and gave no valid token"),
    **NOT_FOUND,
}
NOT_DURABLE: Responses = {503: _error("in force, but the state store cannot write it yet (it retries)")}
STILL_FAULTY: Responses = {409: _error("the GPU is still degraded or unhealthy: release it with force")}


RouteSet = Callable[[FastAPI, Callable[..., None]], None]  # one part's routes: (app, require_token) -> None


def gpu_json(g: GpuStatus, now: float, body: type[B], **extra: Any) -> B:
    """The wire form of one GPU (GET /v1/gpus and the answers of a quarantine or release), with `extra` fields."""
    sample = g.sample
    return body(
        index=g.index,
        uuid=g.uuid,
        name=g.static.name,
        pci_bus_id=g.static.pci_bus_id,
        state=g.state.value,
        quarantined=g.quarantined,
        quarantine_reason=g.quarantine_reason or None,
        quarantined_since=g.quarantined_since,
        epoch=g.epoch,
        suggested_action=g.suggested_action.value,
        findings=[wire.Finding(**f.as_dict()) for f in g.findings],
        drill_active=g.drill_active,
        error=g.error.kind if g.error else None,
        sample_age_s=round(now - sample.t, 3) if sample else None,
        sample=wire.Sample(**{k: getattr(sample, k) for k in SAMPLE_FIELDS if k not in {"index", "uuid"}})
        if sample
        else None,
        xids={str(x): n for x, n in g.xid_counts},
        kernel_xids=[wire.KernelXid(t=e.t, xid=e.xid, line=e.detail) for e in g.kernel_xids],
        trainers=[wire.Trainer(**dataclasses.asdict(t)) for t in g.trainers],
        static=g.static,
        **extra,
    )


def create_api(
    monitor: Monitor,
    token: str,
    *,
    clock: Callable[[], float],
    route_sets: Sequence[RouteSet] = (),
    gpu_views: Sequence[Callable[[int], dict[str, Any]]] = (),
    docs: bool = False,
    access: Access | None = None,
) -> FastAPI:
    """The FastAPI app: /healthz, /v1/*, the status page, and `docs` serves /openapi.json.

    `access`: who may change state over the control socket without the token (None: this process's user).

    Each of `route_sets` adds one part's routes (`route_set(app, require_token)`: incidents, drills); each of
    `gpu_views` adds fields to a GPU's JSON (remediation adds its ranks).
    """
    app = FastAPI(
        title="gpuwatch",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
        responses={
            **NOT_FOUND,
            400: _error("over TCP: no Host header"),
            413: _error("request body over api.max_body_bytes"),
            421: _error("over TCP: a Host the daemon does not answer to (DNS rebinding; api.allowed_hosts)"),
            422: {"model": wire.UnprocessableBody, "description": "invalid input; nothing changed"},
        },
    )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 naming each bad part, without echoing the input (it may be NaN or a lone surrogate)."""
        detail = [
            wire.FieldError(
                loc=[str(part) for part in e.get("loc", ())], msg=str(e.get("msg", "")), type=str(e.get("type", ""))
            )
            for e in exc.errors()
        ]
        return JSONResponse(wire.UnprocessableBody(detail=detail).model_dump(mode="json"), status_code=422)

    allowed = access or Access.for_daemon("")

    def require_token(request: Request) -> None:
        """Who may change state: a caller on the control socket that `allowed` names, else a valid bearer token."""
        caller = peer(request.scope)
        if caller is not None and allowed.may_change_state(caller):
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode()):
            return
        if caller is not None:
            detail = f"uid {caller.uid} may not change state: {allowed.who()} may (or a caller with the token)"
            raise HTTPException(status_code=403, detail=detail)
        raise HTTPException(status_code=401, detail="missing or wrong bearer token (see <state_dir>/token)")

    def snapshot() -> Snapshot:
        return monitor.snapshot

    def gpu_body(g: GpuStatus, now: float) -> wire.Gpu:
        return gpu_json(g, now, wire.Gpu, **{k: v for view in gpu_views for k, v in view(g.index).items()})

    def gpu_or_404(index: int) -> GpuStatus:
        status = monitor.snapshot.gpu(index)
        if status is None:
            raise HTTPException(status_code=404, detail=f"no GPU with index {index}")
        return status

    @app.get("/", response_class=HTMLResponse)
    def status_page() -> HTMLResponse:
        return HTMLResponse(statuspage.render(snapshot(), clock(), socket.gethostname()))

    @app.get(
        "/healthz",
        response_model=wire.Healthz,
        responses={503: {"model": wire.Healthz, "description": "samples are stale or the state store cannot write"}},
    )
    def healthz() -> JSONResponse:
        """Answered by httpserver.front in the daemon, before this app is built; here for its schema."""
        status, body = liveness.healthz(snapshot(), clock(), monitor.config.interval_s)
        return JSONResponse(body, status_code=status)

    @app.get("/v1/gpus")
    def gpus() -> wire.GpuList:
        snap = snapshot()
        now = clock()
        return wire.GpuList(
            t=snap.t,
            backend=snap.backend,
            gpus=[gpu_body(g, now) for g in snap.gpus],
            node_findings=[wire.Finding(**f.as_dict()) for f in snap.node_findings],
        )

    @app.get("/v1/daemon")
    def daemon_info(request: Request) -> wire.DaemonInfo:
        """The daemon's version, directories and stop grace: `gpuwatch launch` gives the ranks this runtime dir.

        The directories only to local callers (gpuwatch.serving.viewer): the runtime dir to any, the state
        dir to root and the daemon's user.
        """
        config = monitor.config
        viewer = viewer_uid(request.scope)
        return wire.DaemonInfo(
            version=__version__,
            state_dir=os.path.abspath(config.state_dir) if sees(viewer, None) else "",
            runtime_dir=os.path.abspath(config.runtime_dir) if viewer is not None else "",
            stop_grace_s=config.trainer.grace_period_s,
        )

    @app.get("/v1/gpus/{index}", responses=NOT_FOUND)
    def gpu(index: int) -> wire.Gpu:
        return gpu_body(gpu_or_404(index), clock())

    @app.get("/v1/findings")
    def findings(
        limit: Annotated[int, Query(ge=1, le=5000)] = 200, gpu: Annotated[int | None, Query(ge=0, le=1023)] = None
    ) -> wire.Findings:
        active = [
            wire.Finding(**f.as_dict()) for g in snapshot().gpus for f in g.findings if gpu is None or g.index == gpu
        ]
        history = monitor.store.findings(limit=limit, gpu=gpu) if monitor.store else []
        return wire.Findings(active=active, history=[wire.FindingRecord(**row) for row in history])

    def durable(index: int, status: GpuStatus, what: str, **outcome: Any) -> wire.GpuChanged:
        """200 only once the change is on disk; else 503: in force now, written when the store can."""
        if monitor.unsaved(index):
            detail = (
                f"GPU {index} is {what} and acted on, but the state store cannot write it "
                f"({monitor.snapshot.store_error}); it is kept in memory and written when the store recovers"
            )
            raise HTTPException(status_code=503, detail=detail)
        return gpu_json(status, clock(), wire.GpuChanged, **outcome)

    @app.post(
        "/v1/gpus/{index}/quarantine", dependencies=[Depends(require_token)], responses={**GUARDED, **NOT_DURABLE}
    )
    def quarantine(index: int, body: wire.QuarantineBody) -> wire.GpuChanged:
        before = gpu_or_404(index)
        after = monitor.quarantine(index, body.reason)
        changed, message = quarantine_outcome(before, after, body.reason)
        return durable(index, after, "quarantined", changed=changed, message=message)

    @app.post(
        "/v1/gpus/{index}/release",
        dependencies=[Depends(require_token)],
        responses={**GUARDED, **NOT_DURABLE, **STILL_FAULTY},
    )
    def release(index: int, body: wire.ReleaseBody) -> wire.GpuChanged:
        before = gpu_or_404(index)
        refusal = None if body.force or body.validate_first else release_refusal(before)  # a test decides
        if refusal is not None:
            raise HTTPException(status_code=409, detail=refusal)
        if not body.validate_first:
            after = monitor.release(index, body.reason)
            changed, message = release_outcome(before, after)
            return durable(index, after, "released", changed=changed, message=message)
        after, result = monitor.release_validated(index, body.reason)  # blocks for the GPU test (threadpool)
        if not result.passed:
            raise HTTPException(409, f"GPU {index} stays quarantined: validation {result.outcome}: {result.reason}")
        changed, message = release_outcome(before, after)
        validation = wire.Validation(outcome=result.outcome, reason=result.reason)
        return durable(index, after, "released", changed=changed, message=message, validation=validation)

    @app.post("/v1/gpus/{index}/inject", dependencies=[Depends(require_token)], responses=GUARDED)
    def inject(index: int, body: wire.InjectBody) -> wire.Injection:
        gpu_or_404(index)
        if not body.fields and body.event is None:
            raise HTTPException(status_code=422, detail="inject needs fields to override or an event")
        if body.event == "xid" and body.xid is None:
            raise HTTPException(status_code=422, detail="an xid event needs `xid`")
        try:
            injection = monitor.inject(index, body.fields, body.duration_s, body.event, body.xid)
        except ConfigError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        return wire.Injection(**injection.as_dict())

    @app.get("/v1/injections")
    def injections() -> wire.Injections:
        return wire.Injections(injections=[wire.Injection(**i.as_dict()) for i in monitor.injections()])

    @app.delete(
        "/v1/injections/{injection_id}",
        dependencies=[Depends(require_token)],
        responses={**GUARDED, 404: _error("no injection with that id is in force")},
    )
    def end_injection(injection_id: int) -> wire.Injection:
        """End an injection now; the answer is the injection, `until` now."""
        ended = monitor.end_injection(injection_id)
        if ended is None:
            raise HTTPException(404, f"no injection {injection_id} is in force (GET /v1/injections lists them)")
        return wire.Injection(**ended.as_dict())

    for route_set in route_sets:
        route_set(app, require_token)
    return app
