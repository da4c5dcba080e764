"""The drill routes of the API, added through the daemon's route hooks.

GET /v1/drills                 stored verdicts, skips, the schedule with its next runs
POST /v1/drills                a verdict from `gpuwatch drill` (stored and exported like a scheduled one)
POST /v1/drills/run            run a drill inside the daemon now (202; the verdict shows in GET /v1/drills)
POST /v1/drills/window         mark findings on one GPU as a drill's for a while, readings untouched
POST /v1/backend/release       let go of NVML/DCGM handles for a reset (GPUs read as drill meanwhile)
POST /v1/backend/reacquire     open the library again
Every POST needs the bearer token.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Annotated, Literal

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from gpuwatch.backends.base import Releasable
from gpuwatch.config import DrillSchedule
from gpuwatch.drills.record import DrillRecord
from gpuwatch.drills.scheduler import DrillScheduler, validate
from gpuwatch.drills.spec import KINDS
from gpuwatch.errors import BackendError, ConfigError
from gpuwatch.node.monitor import Monitor
from gpuwatch.serving import wire


def _known_drill(name: str) -> str:
    if name not in KINDS:
        raise ValueError(f"not one of {', '.join(KINDS)}")
    return name


DrillName = Annotated[str, AfterValidator(_known_drill)]


class StepBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    result: Literal["pass", "fail", "skip", "not_run"]
    duration_s: float = Field(ge=0)
    detail: str = Field(max_length=2000)
    deadline_s: float | None = None


class VerdictBody(BaseModel):
    """A verdict as `Verdict.as_dict()` writes it; `result` and `broke_at` must agree with the steps."""

    model_config = ConfigDict(extra="forbid")
    drill: DrillName
    gpu: int = Field(ge=0)
    uuid: str
    spec: str = Field(max_length=500)
    trigger: Literal["cli", "schedule", "api"]
    started: float
    finished: float
    steps: list[StepBody] = Field(min_length=1, max_length=50)
    result: Literal["pass", "fail"]
    broke_at: str | None

    @model_validator(mode="after")
    def consistent(self) -> VerdictBody:
        failed = next((s.name for s in self.steps if s.result == "fail"), None)
        if (self.result == "fail") != (failed is not None) or self.broke_at != failed:
            raise ValueError("result and broke_at must match the first failed step")
        return self


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    drill: DrillName
    gpu: str = Field(default="idle", max_length=16)
    args: str = Field(default="", max_length=500)
    require_healthy_share: float = Field(default=1.0, ge=0, le=1)
    skip_if_trainers: bool = True
    yes: bool = False


def add_routes(
    app: FastAPI,
    require_token: Callable[..., None],
    monitor: Monitor,
    book: DrillRecord,
    drills: DrillScheduler,
    submit: Callable[[DrillSchedule], None],
) -> None:
    token = [Depends(require_token)]

    # A run is shown as stored: the keys of an older version's verdict are neither added nor dropped.
    @app.get("/v1/drills", response_model_exclude_unset=True)
    def list_drills(limit: int = 100) -> wire.Drills:
        return wire.Drills(
            runs=book.runs(max(1, min(limit, 1000))),
            skipped=book.skipped(),
            schedule=drills.schedule_view(datetime.fromtimestamp(monitor.clock(), tz=timezone.utc)),
            running=drills.busy,
        )

    @app.post("/v1/drills", dependencies=token)
    def store_verdict(body: VerdictBody) -> wire.VerdictStored:
        book.record(body.model_dump())
        return wire.VerdictStored(stored=True, drill=body.drill, result=body.result)

    @app.post("/v1/drills/run", dependencies=token, status_code=202)
    def run_drill(body: RunBody) -> wire.DrillAccepted:
        schedule = DrillSchedule(
            cron="",
            drill=body.drill,
            gpu=body.gpu,
            args=body.args,
            require_healthy_share=body.require_healthy_share,
            skip_if_trainers=body.skip_if_trainers,
            allow_destructive=body.yes,
        )
        if KINDS[body.drill].needs_yes and not body.yes:
            raise HTTPException(status_code=422, detail=f'{body.drill} does something real: send "yes": true')
        try:
            validate(schedule, "drill")
        except ConfigError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        if drills.busy:
            raise HTTPException(status_code=409, detail="a drill is running; see GET /v1/drills")
        submit(schedule)
        return wire.DrillAccepted(accepted=True, drill=body.drill, gpu=body.gpu)

    @app.post("/v1/drills/window", dependencies=token)
    def window(body: wire.WindowBody) -> wire.DrillWindow:
        if body.gpu not in monitor.statics:
            raise HTTPException(status_code=404, detail=f"no GPU with index {body.gpu}")
        injection = monitor.inject(body.gpu, {}, body.duration_s)
        return wire.DrillWindow(gpu=body.gpu, until=injection.until)

    @app.post("/v1/backend/release", dependencies=token)
    def release(body: wire.BackendReleaseBody) -> wire.BackendReleased:
        backend = monitor.backend
        if not isinstance(backend, Releasable):
            return wire.BackendReleased(released=False, detail=f"the {backend.name} backend holds no handles")
        for index in monitor.statics:
            monitor.inject(index, {}, body.duration_s)
        backend.release_handles()
        return wire.BackendReleased(
            released=True, detail=f"{backend.name} released; every GPU reads as a drill for {body.duration_s:g} s"
        )

    @app.post(
        "/v1/backend/reacquire",
        dependencies=token,
        response_model=wire.BackendReacquired,
        responses={503: {"model": wire.BackendReacquired, "description": "the library could not be opened again"}},
    )
    def reacquire() -> JSONResponse:
        backend = monitor.backend
        if not isinstance(backend, Releasable):
            return _reacquired(False, f"the {backend.name} backend holds no handles")
        try:
            statics = backend.reacquire()
        except BackendError as exc:
            return _reacquired(False, str(exc), status_code=503)
        moved = [s.index for s in statics if s.index in monitor.statics and monitor.statics[s.index].uuid != s.uuid]
        detail = f"{backend.name} open again with {len(statics)} GPU(s)"
        if moved:
            detail += f"; GPU(s) {moved} now have another UUID: restart gpuwatch"
        return _reacquired(True, detail)


def _reacquired(reacquired: bool, detail: str, status_code: int = 200) -> JSONResponse:
    body = wire.BackendReacquired(reacquired=reacquired, detail=detail)
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code)
