"""Plain data shared by every layer and by trainers: GPUs, samples, events, findings, snapshots.

Stdlib only. Every type here is immutable so a Snapshot can be handed to any reader
(scrape, API, status.json) without a lock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any


class Health(str, enum.Enum):
    """A GPU's health state (docs/rules.md §States and findings). Ordered by `rank`: worse is higher."""

    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"

    @property
    def rank(self) -> int:
        return _HEALTH_RANK[self]


_HEALTH_RANK = {Health.HEALTHY: 0, Health.UNKNOWN: 1, Health.DEGRADED: 2, Health.UNHEALTHY: 3}


def worst(states: list[Health] | tuple[Health, ...], default: Health = Health.HEALTHY) -> Health:
    """The worst of `states`, or `default` when there are none."""
    return max(states, key=lambda s: s.rank, default=default)


class Severity(str, enum.Enum):
    """How bad a finding is. `info` and `warning` never change the GPU's state."""

    INFO = "info"
    WARNING = "warning"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"

    @property
    def health(self) -> Health:
        """The state a GPU with this finding is in (info/warning leave it healthy)."""
        if self is Severity.UNHEALTHY:
            return Health.UNHEALTHY
        if self is Severity.DEGRADED:
            return Health.DEGRADED
        return Health.HEALTHY


class Action(str, enum.Enum):
    """What an operator or the daemon should do about a finding."""

    NONE = "none"
    RESTART_APP = "restart_app"
    RESET_GPU = "reset_gpu"
    REBOOT = "reboot"
    HARDWARE_INSPECTION = "hardware_inspection"


ERROR_KINDS = ("gpu_lost", "reset_required", "unknown")
EVENT_KINDS = ("xid", "ecc_dbe", "ecc_sbe")

# NVML clocks-event reason bits (nvml.h nvmlClocksEventReason*; docs/hardware-facts.md §Clocks-event reasons).
REASON_GPU_IDLE = 0x1
REASON_APP_CLOCKS = 0x2
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SYNC_BOOST = 0x10
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80
REASON_DISPLAY_CLOCKS = 0x100

REASON_NAMES: dict[int, str] = {
    REASON_GPU_IDLE: "gpu_idle",
    REASON_APP_CLOCKS: "applications_clocks_setting",
    REASON_SW_POWER_CAP: "sw_power_cap",
    REASON_HW_SLOWDOWN: "hw_slowdown",
    REASON_SYNC_BOOST: "sync_boost",
    REASON_SW_THERMAL: "sw_thermal_slowdown",
    REASON_HW_THERMAL: "hw_thermal_slowdown",
    REASON_HW_POWER_BRAKE: "hw_power_brake_slowdown",
    REASON_DISPLAY_CLOCKS: "display_clock_setting",
}


@dataclass(frozen=True)
class GpuStatic:
    """Facts about a GPU read once at start (trace header `static` entries)."""

    index: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    max_sm_clock_mhz: int | None = None
    max_mem_clock_mhz: int | None = None
    power_limit_w: float | None = None
    memory_total_bytes: int | None = None
    slowdown_temp_c: int | None = None
    shutdown_temp_c: int | None = None
    mem_max_temp_c: int | None = None
    gpu_max_temp_c: int | None = None
    pcie_link_gen_max: int | None = None  # the most this GPU and its slot allow (nvmlDeviceGetMaxPcieLinkGeneration)
    pcie_link_width_max: int | None = None  # lanes, likewise (nvmlDeviceGetMaxPcieLinkWidth)


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One reading of one GPU at time `t` (Unix seconds). None: not supported or not read."""

    t: float
    index: int
    uuid: str
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
    pcie_link_gen: int | None = None  # current PCIe generation (trains down at idle on some GPUs)
    pcie_link_width: int | None = None  # current PCIe lanes
    pcie_correctable_errors: int | None = None  # counter (NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS)
    nvlink_links_down: int | None = None  # NVLinks not active; None: the GPU has no NVLink
    nvlink_crc_errors: int | None = None  # counter, all links (CRC flit errors)
    nvlink_recovery_errors: int | None = None  # counter, all links
    fabric_state: int | None = None  # NVSwitch fabric: 1 not started, 2 in progress, 3 completed; None: no fabric
    fabric_status: int | None = None  # NVML return code of the fabric registration (0 success)
    recovery_action: int | None = None  # the driver's verdict (NVML field 230): 0 none, 1 GPU reset, 2 node reboot, …
    pids: tuple[int, ...] = ()


SAMPLE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(GpuSample))


@dataclass(frozen=True)
class GpuEvent:
    """An event-type fault delivered at once (NVML event set): `kind` is xid | ecc_dbe | ecc_sbe."""

    t: float
    index: int
    uuid: str
    kind: str
    xid: int | None = None
    drill: bool = False
    source: str = "nvml"  # nvml (the event set, or any backend) | kmsg (the kernel log, dated by its kernel time)
    detail: str = ""  # the kernel log line, for kmsg events
    pid: int | None = None  # the faulting process the kernel log names (NVML's event names none)


@dataclass(frozen=True)
class GpuError:
    """A read that failed for one GPU: `kind` is gpu_lost | reset_required | unknown."""

    t: float
    index: int
    uuid: str
    kind: str
    detail: str = ""


Reading = GpuSample | GpuEvent | GpuError


@dataclass(frozen=True)
class Finding:
    """A rule's verdict on one GPU: stable snake_case `rule` id, severity, one-line reason, action."""

    rule: str
    severity: Severity
    reason: str
    action: Action = Action.NONE
    t: float = 0.0
    index: int = -1
    uuid: str = ""
    drill: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "t": self.t,
            "gpu": self.index,
            "uuid": self.uuid,
            "rule": self.rule,
            "severity": self.severity.value,
            "reason": self.reason,
            "action": self.action.value,
            "drill": self.drill,
        }


@dataclass(frozen=True)
class TrainerInfo:
    """One trainer rank on a GPU, from NVML's process list, /proc/PID/environ or its own report."""

    pid: int
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    job_id: str | None = None
    gpu_uuid: str | None = None
    step: int | None = None
    first_step: int | None = None
    first_step_t: float | None = None  # when this process finished its first step (Unix time)
    step_t: float | None = None  # when the last step finished (Unix time)
    step_time_s: float | None = None
    step_time_p99_s: float | None = None
    grad_norm: float | None = None
    grad_norm_var: float | None = None
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None
    inactive_split_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    stop_requested: bool | None = None
    allow_drills: bool | None = None
    spare: bool | None = None  # this process took its rank over as a warm spare
    spare_stage: str | None = None  # how far that spare was: standby (the job's set-up done) or warm
    recovery: str | None = None  # how the job recovers: relaunch, or in_place (its survivors go on)
    ended: str | None = None
    pause: str | None = None  # the long pause the loop declared and is in (a checkpoint, an eval pass, a compile)
    pause_until: float | None = None  # its declared end while in force, when it ended after (Unix time)
    updated_t: float | None = None
    uid: int | None = None  # the user the kernel (or /proc) names for the process, never the report's word


@dataclass(frozen=True)
class GpuStatus:
    """Everything known about one GPU at one moment: what readers of a Snapshot see."""

    static: GpuStatic
    state: Health = Health.UNKNOWN
    findings: tuple[Finding, ...] = ()
    quarantined: bool = False
    quarantine_reason: str = ""
    quarantined_since: float | None = None
    epoch: int = 0
    sample: GpuSample | None = None
    error: GpuError | None = None
    xid_counts: tuple[tuple[int, int], ...] = ()
    drill_active: bool = False
    trainers: tuple[TrainerInfo, ...] = ()
    kernel_xids: tuple[GpuEvent, ...] = ()  # the newest XIDs of the kernel log, with their kernel time
    xid_events: tuple[GpuEvent, ...] = ()  # the newest XIDs of both sources, each once (with the kernel's pid)

    @property
    def index(self) -> int:
        return self.static.index

    @property
    def uuid(self) -> str:
        return self.static.uuid

    @property
    def suggested_action(self) -> Action:
        """The action of the worst finding (the one an operator should take first); ties go to the first listed.

        The engine lists the driver's recovery action first, so it outranks the XID catalog's guess.
        """
        ranked = sorted(self.findings, key=lambda f: f.severity.health.rank, reverse=True)
        return ranked[0].action if ranked else Action.NONE


@dataclass(frozen=True)
class Snapshot:
    """The node at one moment. Published whole by the monitor; never mutated."""

    t: float
    backend: str
    gpus: tuple[GpuStatus, ...] = ()
    sample_duration_s: float = 0.0
    sample_errors_total: int = 0
    samples_total: int = 0
    breaker_tripped: bool = False
    breaker_refusals_total: int = 0
    trainers: tuple[TrainerInfo, ...] = ()  # every live report, also those whose GPU uuid matched none
    store_error: str = ""  # why the state store cannot write now; "" while it writes fine
    store_unsaved: int = 0  # quarantine changes in force but not yet written to the store
    store_write_errors_total: int = 0
    kernel_log_readable: bool | None = None  # None: not followed (not a live backend); False: no access
    kernel_sxids_total: int = 0  # NVSwitch SXid lines seen in the kernel log
    node_findings: tuple[Finding, ...] = ()  # about the node, not one GPU (gpu_missing); index -1

    def gpu(self, index: int) -> GpuStatus | None:
        for status in self.gpus:
            if status.index == index:
                return status
        return None
