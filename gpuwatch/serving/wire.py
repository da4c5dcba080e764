"""The JSON bodies of the HTTP API, one pydantic model each: what the server writes and its clients read.

The server (gpuwatch.serving.api, gpuwatch.serving.remediation_api, gpuwatch.drills.routes) returns these, so
/openapi.json documents every body; the CLI, `launch`, the drills and the bench parse what they
get into them (model_validate) and read attributes, not string keys.

Writing is exact, reading is forgiving:

* a field the server always writes still has a default, so a body with a key missing (an older
  daemon, a test's fake) reads as that default, as `.get(key, default)` did; the schema lists it
  as required all the same (json_schema_serialization_defaults_required);
* an `Omittable` field is left out of the JSON when it is None (a trainer's unknown figures, the
  fields only remediation adds to a GPU); every other None is written as null;
* unknown keys are dropped on reading, except in the bodies the store keeps whole (incidents,
  drill runs), which pass through as stored.

No FastAPI here: the clients import this module, and only when they talk to the daemon (pydantic
takes ~0.1 s to import, which `gpuwatch --help` should not pay).
"""

from __future__ import annotations

import unicodedata
from typing import Annotated, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from gpuwatch.errors import DaemonError
from gpuwatch.model import GpuEvent, GpuStatic

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def _none(value: object) -> bool:
    return value is None


Omittable = Annotated[T | None, Field(exclude_if=_none)]
"""A field that is absent from the JSON, rather than null, when it is None."""


class Body(BaseModel):
    """A response body: every field the server writes is required in the schema, missing keys read as defaults."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class Stored(Body):
    """A body kept whole in the store: keys this version does not know pass through."""

    model_config = ConfigDict(extra="allow")


def read(model: type[M], answer: object, what: str) -> M:
    """The daemon's `answer` to `what` (e.g. "GET /v1/gpus") as `model`.

    Raises:
        DaemonError: the answer is not that body (another program on the port, a mismatched version).
    """
    try:
        return model.model_validate(answer)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the body"
        raise DaemonError(f"{what}: the daemon's answer is not a {model.__name__} ({where}: {first['msg']})") from None


# --- errors ---------------------------------------------------------------------------------------


class ErrorBody(Body):
    detail: str


class FieldError(Body):
    loc: list[str | int]
    msg: str
    type: str


class UnprocessableBody(Body):
    """A 422: body or query validation lists each bad part; a handler's own check says it in one string."""

    detail: list[FieldError] | str


# --- a GPU ----------------------------------------------------------------------------------------


class Finding(Body):
    """A rule's verdict on one GPU (gpuwatch.model.Finding.as_dict)."""

    t: float = 0.0
    gpu: int = -1
    uuid: str = ""
    rule: str
    severity: str = "info"
    reason: str = ""
    action: str = "none"
    drill: bool = False


class Sample(Body):
    """One reading of a GPU: gpuwatch.model.GpuSample without its index and uuid (the GPU's own)."""

    t: float
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    power_w: float | None = None
    temp_c: int | None = None
    mem_temp_c: int | None = None
    util_gpu_pct: int | None = None
    util_mem_pct: int | None = None
    memory_used_bytes: int | None = None
    clocks_event_reasons: int | None = None
    pstate: int | None = None
    energy_mj: int | None = None
    violation_power_ns: int | None = None
    violation_thermal_ns: int | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    remapped_cor: int | None = None
    remapped_unc: int | None = None
    remapped_pending: int | None = None
    remapped_failure: int | None = None
    pcie_replay: int | None = None
    power_instant_mw: int | None = None
    pcie_link_gen: int | None = None
    pcie_link_width: int | None = None
    pcie_correctable_errors: int | None = None
    nvlink_links_down: int | None = None
    nvlink_crc_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    fabric_state: int | None = None
    fabric_status: int | None = None
    recovery_action: int | None = None
    pids: list[int] = []


class KernelXid(Body):
    """An XID line of the kernel log, with its kernel time."""

    t: float
    xid: int | None = None
    line: str = ""


class Trainer(Body):
    """One trainer rank (gpuwatch.model.TrainerInfo): only what is known of it is written."""

    pid: int
    rank: Omittable[int] = None
    local_rank: Omittable[int] = None
    world_size: Omittable[int] = None
    local_world_size: Omittable[int] = None
    job_id: Omittable[str] = None
    gpu_uuid: Omittable[str] = None
    step: Omittable[int] = None
    first_step: Omittable[int] = None
    first_step_t: Omittable[float] = None
    step_t: Omittable[float] = None
    step_time_s: Omittable[float] = None
    step_time_p99_s: Omittable[float] = None
    grad_norm: Omittable[float] = None
    grad_norm_var: Omittable[float] = None
    reserved_bytes: Omittable[int] = None
    allocated_bytes: Omittable[int] = None
    inactive_split_bytes: Omittable[int] = None
    num_alloc_retries: Omittable[int] = None
    num_ooms: Omittable[int] = None
    stop_requested: Omittable[bool] = None
    allow_drills: Omittable[bool] = None
    spare: Omittable[bool] = None
    spare_stage: Omittable[str] = None
    recovery: Omittable[str] = None
    ended: Omittable[str] = None
    pause: Omittable[str] = None
    pause_until: Omittable[float] = None
    updated_t: Omittable[float] = None
    uid: Omittable[int] = None


class Rank(Trainer):
    """A trainer as remediation maps it: its GPU (null: none matched) and where it was learnt from."""

    gpu: int | None = None
    sources: list[str] = []
    fragmentation_ratio: Omittable[float] = None


class GpuBase(Body):
    """What the daemon knows of one GPU now."""

    index: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    state: str = "unknown"
    quarantined: bool = False
    quarantine_reason: str | None = None
    quarantined_since: float | None = None
    epoch: int = 0
    suggested_action: str = "none"
    findings: list[Finding] = []
    drill_active: bool = False
    error: str | None = None
    sample_age_s: float | None = None
    sample: Sample | None = None
    xids: dict[str, int] = {}
    kernel_xids: list[KernelXid] = []
    trainers: list[Trainer] = []
    static: GpuStatic | None = None


class Gpu(GpuBase):
    """GET /v1/gpus/{index}, and each GPU of GET /v1/gpus: with remediation, its ranks and their findings."""

    ranks: Omittable[list[Rank]] = None
    trainer_findings: Omittable[list[Finding]] = None


class Validation(Body):
    outcome: str
    reason: str


class GpuChanged(GpuBase):
    """The answer of a quarantine or release: the GPU after it, and what changed, in words."""

    changed: bool = False
    message: str = ""
    validation: Omittable[Validation] = None


class GpuList(Body):
    """GET /v1/gpus, and the findings on the node itself (gpu_missing: fewer GPUs than expected_gpus)."""

    t: float
    backend: str
    gpus: list[Gpu] = []
    node_findings: list[Finding] = []


class DaemonInfo(Body):
    """GET /v1/daemon: where this daemon keeps its files, and how long it lets a rank stop. `gpuwatch launch` passes
    `runtime_dir` to the ranks, so their reports reach the daemon that quarantines their GPUs whatever runtime dir
    it was started with, and waits `stop_grace_s` for the ranks it reports to stop before it stops them itself."""

    version: str = ""
    state_dir: str = ""
    runtime_dir: str = ""
    stop_grace_s: float = 60.0  # trainer.grace_period_s


# --- findings, injections, health -----------------------------------------------------------------


class FindingRecord(Body):
    """A finding as the store keeps it: when it opened and closed (null: still active)."""

    opened: float
    closed: float | None = None
    gpu: int
    uuid: str = ""
    rule: str
    severity: str
    reason: str = ""
    action: str = "none"
    drill: bool = False


class Findings(Body):
    """GET /v1/findings."""

    active: list[Finding] = []
    history: list[FindingRecord] = []


InjectValue = StrictBool | StrictInt | StrictFloat | StrictStr | list[StrictInt] | None


class Injection(Body):
    """A drill's injection: the readings it overrides until `until`, and/or its event."""

    id: int
    gpu: int = -1
    fields: dict[str, InjectValue] = {}
    started: float = 0.0
    until: float = 0.0
    event: GpuEvent | None = None


class Injections(Body):
    """GET /v1/injections."""

    injections: list[Injection] = []


class Healthz(Body):
    """GET /healthz: `ok`, `stale` (no recent sample) or `store_degraded` (with why and how much is unsaved)."""

    status: str
    last_sample_age_s: float
    gpus: int
    store_error: Omittable[str] = None
    store_unsaved_changes: Omittable[int] = None


# --- remediation: incidents and trainers ----------------------------------------------------------


class IncidentRank(Body):
    """A rank an incident stopped, and how it ended (exited, SIGTERM, SIGKILL, died, or null: running)."""

    pid: int
    rank: int | None = None
    local_rank: int | None = None
    gpu: int | None = None
    job: str | None = None
    uid: int | None = None
    on_quarantined_gpu: bool = False
    ended: str | None = None


class Incident(Stored):
    """One job stop (or idle quarantine), as gpuwatch.remediation.incidents writes it."""

    id: int
    t: float
    kind: str = ""
    gpu: int | None = None
    uuid: str = ""
    cause: str = ""
    reason: str = ""
    auto: bool = True
    drill: bool = False
    job: str | None = None
    uid: int | None = None
    path: str = "relaunch"  # relaunch, or in_place (the survivors went on without the ranks that left)
    stop_signal: str = ""
    status: str = ""
    ranks: list[IncidentRank] = []
    began_t: float | None = None  # when the fault began (Unix time); detected_t: when the daemon knew
    detected_t: float | None = None
    stopped_t: float | None = None
    next_step_t: float | None = None  # when the job finished its next step
    time_to_stop_s: float | None = None
    time_to_resume_s: float | None = None  # next_step_t - began_t
    steps_lost: int | None = None
    spare_stage: str | None = None  # path spare: how far the spare was (standby, warm)
    last_step: int | None = None
    resumed_step: int | None = None


class Incidents(Body):
    """GET /v1/incidents, newest first."""

    incidents: list[Incident] = []


class HeldReport(Trainer):
    """A rank's latest report as the daemon holds it (`uid`: the kernel's word), and whether its process runs."""

    alive: bool


class Trainers(Body):
    """GET /v1/trainers: every rank remediation maps, the trainer rules' findings, and every report held.

    `reports` includes ranks that ended or died (for DEAD_KEEP_S after their process is gone).
    """

    ranks: list[Rank] = []
    findings: list[Finding] = []
    reports: list[HeldReport] = []


# --- drills ---------------------------------------------------------------------------------------


class DrillStep(Body):
    name: str
    result: str
    duration_s: float
    detail: str
    deadline_s: float | None = None


class DrillRun(Stored):
    """A stored verdict: when it was recorded, then the verdict as posted or run."""

    t: float
    drill: str
    result: str
    gpu: int
    uuid: str = ""
    spec: str = ""
    trigger: str = ""
    started: float = 0.0
    finished: float = 0.0
    steps: list[DrillStep] = []
    broke_at: str | None = None


class DrillSkip(Body):
    """How often a guard skipped a scheduled drill, by reason."""

    drill: str
    reason: str
    count: int


class ScheduleEntry(Body):
    entry: int
    cron: str
    drill: str
    gpu: str
    next_runs: list[str] = []


class Drills(Body):
    """GET /v1/drills."""

    runs: list[DrillRun] = []
    skipped: list[DrillSkip] = []
    schedule: list[ScheduleEntry] = []
    running: bool = False


class VerdictStored(Body):
    stored: bool
    drill: str
    result: str


class DrillAccepted(Body):
    accepted: bool
    drill: str
    gpu: str


class DrillWindow(Body):
    gpu: int
    until: float


class BackendReleased(Body):
    released: bool
    detail: str


class BackendReacquired(Body):
    reacquired: bool
    detail: str


# --- request bodies -------------------------------------------------------------------------------


def one_line_text(value: str) -> str:
    """A reason goes to the database, the journal and status pages: printable UTF-8 on one line only."""
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise ValueError("contains a lone surrogate (not valid UTF-8)")
    if any(unicodedata.category(c) == "Cc" for c in value):
        raise ValueError("contains a control character (newline, tab, escape, ...)")
    return value


# The schema says "no control characters" as a pattern; one_line_text enforces it with a clearer message.
Reason = Annotated[
    str,
    Field(min_length=1, max_length=500, json_schema_extra={"pattern": r"^[^\x00-\x1f\x7f-\x9f]+$"}),
    AfterValidator(one_line_text),
]


class QuarantineBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Reason


class ReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Reason = "operator"
    force: bool = False  # needed to release a GPU that is still degraded or unhealthy (409 without it)
    validate_first: bool = Field(default=False, alias="validate")  # run the GPU test; release only if it passes


class InjectBody(BaseModel):
    """A drill's injection: sample fields to override for `duration_s`, and/or one event.

    Each field's type and range is checked against the sample field it overrides
    (gpuwatch.node.injection.checked_injection).
    """

    model_config = ConfigDict(extra="forbid")
    fields: dict[str, InjectValue] = Field(default_factory=dict)
    duration_s: float = Field(default=60.0, gt=0, le=86400, allow_inf_nan=False)
    event: Literal["xid", "ecc_dbe", "ecc_sbe"] | None = None
    xid: int | None = Field(default=None, ge=1, le=1000)


class WindowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu: int = Field(ge=0)
    duration_s: float = Field(gt=0, le=86400)


class BackendReleaseBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    duration_s: float = Field(default=600.0, gt=0, le=86400)
