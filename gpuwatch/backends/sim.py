"""The simulated node (`--backend sim`): H200-like GPUs under a DDP training job, with scripted faults.

Deterministic: a sample is a function of the seed, the GPU index and the time since the timeline
started (plus counters accumulated by earlier samples), so tests, demos and the golden /metrics repeat
exactly. The numbers come from tests/data/h200-healthy-workload.jsonl and the measurements in
docs/hardware-facts.md §A healthy H200, measured: a capped H200 runs 1425–1515 MHz with reason 0x4 at up
to ~690 W, and a healthy 2-rank DDP job swings 290–682 W at 100% utilization as compute and all-reduce
phases alternate.
"""

from __future__ import annotations

import math
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwatch.config import Config
from gpuwatch.errors import BackendError, ConfigError, GpuReadError
from gpuwatch.model import (
    REASON_GPU_IDLE,
    REASON_HW_POWER_BRAKE,
    REASON_HW_SLOWDOWN,
    REASON_HW_THERMAL,
    REASON_SW_POWER_CAP,
    REASON_SW_THERMAL,
    GpuError,
    GpuEvent,
    GpuSample,
    GpuStatic,
)

# The training timeline: busy for 540 s, then a 60 s checkpoint/eval pause, every 10 minutes.
CYCLE_S = 600.0
BUSY_S = 540.0
_THERMAL_TAU_S = 20.0
# Share of busy samples that land in an all-reduce phase (SMs wait on NCCL: low power, full clock, no cap).
_COMM_SHARE = 0.03
_CAPPED_CLOCKS = tuple(range(1425, 1516, 15))
_MAX_SM_MHZ = 1980
_IDLE_SM_MHZ = 345
_MEM_MHZ = 3201
_GIB = 1 << 30
_UUID_NAMESPACE = uuid.UUID("5d1f6a34-0c5e-4a8e-9a5b-6f0e4b1c2d3e")

H200 = GpuStatic(
    index=0,
    uuid="",
    name="NVIDIA H200",
    max_sm_clock_mhz=_MAX_SM_MHZ,
    max_mem_clock_mhz=_MEM_MHZ,
    power_limit_w=700.0,
    memory_total_bytes=150754820096,
    slowdown_temp_c=89,
    shutdown_temp_c=95,
    mem_max_temp_c=95,
    gpu_max_temp_c=87,
    pcie_link_gen_max=5,
    pcie_link_width_max=16,
)


@dataclass(frozen=True)
class Fault:
    """One scripted fault on GPU `gpu` (taken modulo the GPU count), from `start_s` after the timeline starts.

    Kinds that change samples (clock and power ones only while the GPU is busy):
    `clock_low` 500 MHz with no reason; `hw_slowdown`, `hw_thermal`, `hw_power_brake`, `sw_thermal`
    low clocks with reason 0x8, 0x40, 0x80, 0x20; `power_unstable` power collapses to 100–140 W with
    clocks dropping and no reason on about half the samples; `hot` temperature at slowdown − 2;
    `sbe_rate` 3000 correctable ECC errors a minute; `remap_pending`, `remap_failure`; `gpu_lost`
    every read fails; `reset_required` every read fails with the driver asking for a reset; `read_error`
    every read fails for no named reason; `recovery_action` the driver asks for a GPU reset; `pcie_x8` the PCIe link
    trained down to x8 (busy or idle); `pcie_errors` 300 PCIe correctable errors a minute; `nvlink_down`
    one of 18 NVLinks inactive; `nvlink_errors` 300 NVLink CRC errors a minute; `fabric_not_ready`
    the NVSwitch fabric registration stuck in progress. A healthy sim GPU is PCIe-only, as the lab's
    H200 (NVLink and fabric read None); the NVLink and fabric kinds give it 18 links and a fabric.
    Kinds that are events: `ecc_dbe` (counters +1 and an ecc_dbe event) and
    `xid` (event `xid`, again every `every_s` when set).
    """

    kind: str
    gpu: int
    start_s: float
    xid: int | None = None
    every_s: float | None = None


@dataclass(frozen=True)
class Scenario:
    """A named set of faults, and rule settings that shorten windows so the faults are judged quickly."""

    name: str
    description: str
    faults: tuple[Fault, ...] = ()
    rules_overrides: dict[str, float] = field(default_factory=dict)
    idle: bool = False  # no load and no process on any GPU (what a drill that needs an empty GPU wants)
    judged_by_s: float = 0.0  # seconds from the start by which the fault's rule has fired (`gpuwatch check`)


_READ_ERRORS = {
    "gpu_lost": ("gpu_lost", "has fallen off the bus"),
    "reset_required": ("reset_required", "needs a reset"),
    "read_error": ("unknown", "did not answer"),
}
_FAULTY_GPU = 1
_FAULT_START_S = 10.0
_CLOCK_FAST = {"clock_window_s": 30.0}
_THERMAL_FAST = {"thermal_window_s": 30.0}
_LINK_FAST = {"link_window_s": 30.0}


def _rule_scenario(
    rule: str, description: str, fault: Fault, overrides: dict[str, float] | None = None, judged_after_s: float = 40.0
) -> Scenario:
    """One fault on GPU 1 from t+10 s, judged `judged_after_s` after it starts (windows, rates, repeats)."""
    return Scenario(rule, description, (fault,), dict(overrides or {}), judged_by_s=_FAULT_START_S + judged_after_s)


def _fault(kind: str, xid: int | None = None, every_s: float | None = None) -> Fault:
    return Fault(kind, _FAULTY_GPU, _FAULT_START_S, xid, every_s)


_SCENARIO_LIST = (
    Scenario(
        "demo",
        "GPU 3's SM clock collapses to 500-700 MHz with HW slowdown from t+20s; "
        "GPU 5 gets an uncorrectable ECC error (ecc_dbe event) at t+30s.",
        (Fault("hw_slowdown", 3, 20.0), Fault("ecc_dbe", 5, 30.0)),
        dict(_CLOCK_FAST),
        judged_by_s=60.0,
    ),
    Scenario("healthy", "DDP training on every GPU with a 60 s checkpoint pause every 10 minutes; no faults."),
    Scenario("idle", "Every GPU idle with no process on it; no faults.", idle=True),
    _rule_scenario(
        "sm_clock_low_unexplained",
        "SM clock 500 MHz at 100% utilization with no clocks-event reason.",
        _fault("clock_low"),
        _CLOCK_FAST,
    ),
    _rule_scenario(
        "clocks_hw_slowdown",
        "SM clock 500-700 MHz under load with HW slowdown (0x8).",
        _fault("hw_slowdown"),
        _CLOCK_FAST,
    ),
    _rule_scenario(
        "clocks_hw_thermal",
        "SM clock 600-900 MHz under load with HW thermal slowdown (0x40), GPU at 76-80 C.",
        _fault("hw_thermal"),
        {**_CLOCK_FAST, **_THERMAL_FAST},
    ),
    _rule_scenario(
        "clocks_hw_power_brake",
        "SM clock 500-800 MHz under load with HW power brake (0x80).",
        _fault("hw_power_brake"),
        _CLOCK_FAST,
    ),
    _rule_scenario(
        "clocks_sw_thermal",
        "SM clock 1005-1200 MHz under load with SW thermal slowdown (0x20), HBM at 95-96 C.",
        _fault("sw_thermal"),
        {**_CLOCK_FAST, **_THERMAL_FAST},
    ),
    _rule_scenario(
        "power_unstable",
        "At 100% utilization power collapses to 100-140 W on about half the samples, clocks drop, no reason.",
        _fault("power_unstable"),
        judged_after_s=290.0,
    ),
    _rule_scenario(
        "ecc_uncorrectable", "An uncorrectable ECC error: DBE counters +1 and an ecc_dbe event.", _fault("ecc_dbe")
    ),
    _rule_scenario(
        "ecc_correctable_rate", "Correctable (SBE) ECC errors rise by 3000 a minute.", _fault("sbe_rate"), None, 590.0
    ),
    _rule_scenario("row_remap_pending", "A row remap is pending (needs a GPU reset).", _fault("remap_pending")),
    _rule_scenario("row_remap_failure", "Row remapping failed.", _fault("remap_failure")),
    _rule_scenario("xid_critical", "XID 79: the GPU has fallen off the bus (event only).", _fault("xid", xid=79)),
    _rule_scenario("xid_app", "One XID 31 (an application's MMU fault).", _fault("xid", xid=31), None, 5.0),
    _rule_scenario(
        "xid_app_repeated", "XID 31 (MMU fault) every 20 s.", _fault("xid", xid=31, every_s=20.0), None, 110.0
    ),
    _rule_scenario(
        "thermal_margin_low", "GPU temperature 2 C below its slowdown temperature.", _fault("hot"), _THERMAL_FAST
    ),
    _rule_scenario("gpu_lost", "Every read of the GPU fails with gpu_lost.", _fault("gpu_lost")),
    _rule_scenario(
        "gpu_reset_required", "Every read of the GPU fails: the driver needs a GPU reset.", _fault("reset_required")
    ),
    _rule_scenario("gpu_read_error", "Every read of the GPU fails for no named reason.", _fault("read_error")),
    _rule_scenario(
        "gpu_recovery_action", "The driver's recovery action asks for a GPU reset.", _fault("recovery_action")
    ),
    _rule_scenario(
        "pcie_link_degraded", "The PCIe link trained down to gen 5 x8 (of x16).", _fault("pcie_x8"), _LINK_FAST
    ),
    _rule_scenario("pcie_error_rate", "PCIe correctable errors rise by 300 a minute.", _fault("pcie_errors")),
    _rule_scenario("nvlink_down", "One of 18 NVLinks is not active.", _fault("nvlink_down"), _LINK_FAST),
    _rule_scenario("nvlink_error_rate", "NVLink CRC errors rise by 300 a minute.", _fault("nvlink_errors")),
    _rule_scenario(
        "fabric_not_ready",
        "The NVSwitch fabric registration stays in progress.",
        _fault("fabric_not_ready"),
        _LINK_FAST,
    ),
)
# Last, not among the rule scenarios: every family of /metrics at once.
_ALL_SERIES = Scenario(
    "all_series",
    "Every kind of reading a node can show (for dashboards, and the golden /metrics file): the demo's two "
    "faults, NVLink CRC errors on GPU 1, a fabric stuck in progress on GPU 2, XID 13 on GPU 4 at t+15s, "
    "GPU 6 falls off the bus at t+40s.",
    (
        Fault("hw_slowdown", 3, 20.0),
        Fault("ecc_dbe", 5, 30.0),
        Fault("nvlink_errors", 1, 10.0),
        Fault("fabric_not_ready", 2, 10.0),
        Fault("xid", 4, 15.0, xid=13),
        Fault("gpu_lost", 6, 40.0),
    ),
    {**_CLOCK_FAST, **_LINK_FAST},
    judged_by_s=90.0,
)
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (*_SCENARIO_LIST, _ALL_SERIES)}


def scenario(name: str) -> Scenario:
    """The scenario called `name`.

    Raises:
        ConfigError: naming the choices.
    """
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ConfigError(f"sim.scenario: unknown scenario {name!r} (choose from {', '.join(SCENARIOS)})") from None


@dataclass(frozen=True)
class _Profile:
    """What differs between GPUs of one node for a given seed (cooling, memory footprint, trainer PID)."""

    idle_temp_c: int
    hot_temp_c: int
    memory_used_bytes: int
    pid: int
    energy_mj: int


@dataclass
class _Counters:
    """Counters that grow with the time between samples: energy and violation time."""

    last_t: float | None
    energy_mj: float
    violation_power_ns: int = 0
    violation_thermal_ns: int = 0
    last_slow: dict[str, Any] = field(default_factory=dict)  # what the last slow sample read, repeated until the next


def _load_level(t_rel: float) -> float:
    """0 (cold idle) … 1 (hot under load), following the busy/idle schedule with a thermal time constant."""
    phase = t_rel % CYCLE_S
    if phase < BUSY_S:
        # The job is already warm when the timeline starts; later busy phases ramp up from the pause.
        return 1.0 if t_rel < CYCLE_S else 1.0 - math.exp(-phase / _THERMAL_TAU_S)
    return math.exp(-(phase - BUSY_S) / _THERMAL_TAU_S)


def _clock(rng: random.Random, low: int, high: int) -> int:
    """A clock between low and high in the 15 MHz steps H200 clocks move in."""
    return rng.choice(range(low, high + 1, 15))


class SimBackend:
    """`config.sim.gpus` simulated H200s running `config.sim.scenario`.

    The timeline starts at the first `now` given to sample() (or at open() for wait_events called first).
    `clock` is what wait_events compares scripted event times with; tests pass a fake one.
    """

    name = "sim"

    def __init__(self, config: Config, clock: Callable[[], float] = time.time) -> None:
        self.scenario = scenario(config.sim.scenario)
        self._seed = config.sim.seed
        self.clock = clock
        n = config.sim.gpus
        self._statics = tuple(
            replace(
                H200,
                index=i,
                uuid=f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'sim:{self._seed}:{i}')}",
                pci_bus_id=f"00000000:{0x18 + 3 * i:02X}:00.0",
            )
            for i in range(n)
        )
        self._faults = tuple(replace(f, gpu=f.gpu % n) for f in self.scenario.faults)
        self._event_faults = tuple(f for f in self._faults if f.kind in ("xid", "ecc_dbe"))
        self._delivered = [0] * len(self._event_faults)
        job = random.Random(f"{self._seed}:job")
        pid_base = job.randint(10_000, 90_000)
        self._profiles = tuple(self._profile(i, pid_base) for i in range(n))
        self._counters = [_Counters(None, p.energy_mj) for p in self._profiles]
        self._t0: float | None = None
        self._open_t: float | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False

    def _profile(self, index: int, pid_base: int) -> _Profile:
        rng = random.Random(f"{self._seed}:{index}:profile")
        return _Profile(
            idle_temp_c=rng.randint(34, 38),
            hot_temp_c=rng.randint(62, 68),
            memory_used_bytes=rng.randint(112, 132) * _GIB + rng.randrange(0, _GIB, 2 << 20),
            pid=pid_base + index,
            energy_mj=rng.randint(2_000_000, 9_000_000),
        )

    def open(self) -> tuple[GpuStatic, ...]:
        self._open_t = self.clock()
        return self._statics

    def _start(self, now: float) -> float:
        """The timeline's start, fixed by the first caller."""
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            return self._t0

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        """Read one simulated GPU at `now`.

        Raises:
            GpuReadError: gpu_lost, when a `gpu_lost` fault is active on this GPU.
            BackendError: there is no GPU `index`.
        """
        if not 0 <= index < len(self._statics):
            raise BackendError(f"sim: no GPU {index} (this node has {len(self._statics)})")
        t_rel = max(0.0, now - self._start(now))
        faults = [(f, t_rel - f.start_s) for f in self._faults if f.gpu == index and t_rel >= f.start_s]
        for fault, _ in faults:
            if fault.kind in _READ_ERRORS:
                kind, detail = _READ_ERRORS[fault.kind]
                raise GpuReadError(kind, f"GPU {index} {detail} (simulated)")
        rng = random.Random(f"{self._seed}:{index}:{round(t_rel * 1000)}")
        sample = self._healthy(index, now, t_rel, rng)
        busy = (sample.util_gpu_pct or 0) > 0
        for fault, elapsed in faults:
            sample = _apply(fault, elapsed, sample, busy, rng)
        # NVML's instantaneous reading runs above the 1 s average under load (885 W peaks in the trace).
        instant_mw = round((sample.power_w or 0.0) * 1000 * rng.uniform(0.97, 1.15))
        return self._count(replace(sample, power_instant_mw=instant_mw), slow)

    def _healthy(self, index: int, now: float, t_rel: float, rng: random.Random) -> GpuSample:
        profile = self._profiles[index]
        phase = BUSY_S + 60.0 if self.scenario.idle else t_rel % CYCLE_S
        level = 0.0 if self.scenario.idle else _load_level(t_rel)
        temp = profile.idle_temp_c + level * (profile.hot_temp_c - profile.idle_temp_c) + rng.uniform(-0.6, 0.6)
        mem_temp = profile.idle_temp_c + 3 + level * (profile.hot_temp_c - profile.idle_temp_c - 8) + rng.uniform(-1, 1)
        if phase < BUSY_S:
            util = 100 if rng.random() < 0.9 else rng.randint(97, 99)
            if rng.random() < _COMM_SHARE:
                power, sm, reasons, util_mem = rng.uniform(290, 480), _MAX_SM_MHZ, 0, rng.randint(8, 20)
            else:
                power, sm, reasons = rng.uniform(600, 682), rng.choice(_CAPPED_CLOCKS), REASON_SW_POWER_CAP
                util_mem = rng.randint(28, 40)
        else:
            # As in the recorded trace: one second at full clock with no reason, then deep idle at 345 MHz.
            idle_s = phase - BUSY_S
            util, util_mem = 0, 0
            power = 82.0 + 45.0 * math.exp(-idle_s / 1.5) + rng.uniform(0.0, 1.0)
            sm, reasons = (_MAX_SM_MHZ, 0) if idle_s < 2.0 else (_IDLE_SM_MHZ, REASON_GPU_IDLE)
        return GpuSample(
            t=now,
            index=index,
            uuid=self._statics[index].uuid,
            sm_clock_mhz=sm,
            mem_clock_mhz=_MEM_MHZ,
            power_w=round(power, 3),
            temp_c=round(temp),
            mem_temp_c=round(mem_temp),
            util_gpu_pct=util,
            util_mem_pct=util_mem,
            memory_used_bytes=profile.memory_used_bytes,
            clocks_event_reasons=reasons,
            pstate=0,
            ecc_sbe_volatile=0,
            ecc_dbe_volatile=0,
            ecc_sbe_aggregate=0,
            ecc_dbe_aggregate=0,
            remapped_cor=0,
            remapped_unc=0,
            remapped_pending=0,
            remapped_failure=0,
            pcie_link_gen=5,
            pcie_link_width=16,
            pcie_correctable_errors=0,
            recovery_action=0,
            pids=() if self.scenario.idle else (profile.pid,),
        )

    def _count(self, sample: GpuSample, slow: bool) -> GpuSample:
        """Advance energy and violation counters by the time since this GPU's last sample; read them if `slow`,
        else repeat the last slow reading, as the NVML backend does."""
        with self._lock:
            c = self._counters[sample.index]
            dt = 0.0 if c.last_t is None else max(0.0, sample.t - c.last_t)
            c.last_t = sample.t if c.last_t is None else max(c.last_t, sample.t)
            c.energy_mj += (sample.power_w or 0.0) * dt * 1000.0
            reasons = sample.clocks_event_reasons or 0
            if reasons & REASON_SW_POWER_CAP:
                c.violation_power_ns += round(dt * 1e9)
            if reasons & (REASON_SW_THERMAL | REASON_HW_THERMAL):
                c.violation_thermal_ns += round(dt * 1e9)
            if slow:
                c.last_slow = {
                    "energy_mj": round(c.energy_mj),
                    "violation_power_ns": c.violation_power_ns,
                    "violation_thermal_ns": c.violation_thermal_ns,
                    "pcie_replay": 0,
                }
            return replace(sample, **c.last_slow)

    def wait_events(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        """Return the scripted events whose time has come; else wait for the next one, the timeout or close()."""
        deadline = time.monotonic() + timeout_s
        while not self._closed:
            now = self.clock()
            t0 = self._start(self._open_t if self._open_t is not None else now)
            due, next_t = self._take_due(now - t0)
            if due:
                return [
                    GpuEvent(t=t0 + at, index=f.gpu, uuid=self._statics[f.gpu].uuid, kind=f.kind, xid=f.xid)
                    for at, f in sorted(due, key=lambda d: d[0])
                ]
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            if next_t is not None:
                wait = min(wait, max(0.001, t0 + next_t - now))
            self._wake.wait(wait)
        return []

    def _take_due(self, t_rel: float) -> tuple[list[tuple[float, Fault]], float | None]:
        """Scripted events at or before `t_rel` not delivered yet (marked delivered), and the next one's time."""
        due: list[tuple[float, Fault]] = []
        next_t: float | None = None
        with self._lock:
            for i, fault in enumerate(self._event_faults):
                while True:
                    k = self._delivered[i]
                    if k > 0 and fault.every_s is None:
                        break
                    at = fault.start_s + k * (fault.every_s or 0.0)
                    if at > t_rel:
                        next_t = at if next_t is None else min(next_t, at)
                        break
                    due.append((at, fault))
                    self._delivered[i] = k + 1
        return due, next_t

    def close(self) -> None:
        """Wake any waiting wait_events; it and later calls return no events."""
        self._closed = True
        self._wake.set()


def _apply(fault: Fault, elapsed: float, s: GpuSample, busy: bool, rng: random.Random) -> GpuSample:
    """`s` changed by an active fault (`elapsed` seconds after it started)."""
    kind = fault.kind
    if kind == "ecc_dbe":
        return replace(
            s, ecc_dbe_volatile=(s.ecc_dbe_volatile or 0) + 1, ecc_dbe_aggregate=(s.ecc_dbe_aggregate or 0) + 1
        )
    if kind == "sbe_rate":
        extra = int(elapsed * 50)
        return replace(
            s, ecc_sbe_volatile=(s.ecc_sbe_volatile or 0) + extra, ecc_sbe_aggregate=(s.ecc_sbe_aggregate or 0) + extra
        )
    if kind == "remap_pending":
        return replace(s, remapped_cor=(s.remapped_cor or 0) + 1, remapped_pending=1)
    if kind == "remap_failure":
        return replace(s, remapped_failure=1)
    if kind == "hot":
        return replace(s, temp_c=(H200.slowdown_temp_c or 0) - 2)
    if kind in _LINK_FAULTS:
        return _LINK_FAULTS[kind](s, int(elapsed * 5))
    if not busy:
        return s
    if kind == "clock_low":
        return replace(
            s,
            sm_clock_mhz=rng.choice((495, 510)),
            clocks_event_reasons=0,
            util_gpu_pct=100,
            power_w=_watts(rng, 230, 270),
        )
    if kind == "hw_slowdown":
        return replace(
            s,
            sm_clock_mhz=_clock(rng, 495, 705),
            clocks_event_reasons=REASON_HW_SLOWDOWN,
            power_w=_watts(rng, 250, 350),
        )
    if kind == "hw_thermal":
        return replace(
            s,
            sm_clock_mhz=_clock(rng, 600, 900),
            clocks_event_reasons=REASON_HW_THERMAL,
            power_w=_watts(rng, 300, 400),
            temp_c=rng.randint(76, 80),
        )
    if kind == "hw_power_brake":
        return replace(
            s,
            sm_clock_mhz=_clock(rng, 495, 795),
            clocks_event_reasons=REASON_HW_POWER_BRAKE,
            power_w=_watts(rng, 200, 300),
        )
    if kind == "sw_thermal":
        return replace(
            s,
            sm_clock_mhz=_clock(rng, 1005, 1200),
            clocks_event_reasons=REASON_SW_THERMAL,
            power_w=_watts(rng, 450, 550),
            temp_c=rng.randint(78, 82),
            mem_temp_c=rng.randint(95, 96),
        )
    if kind == "power_unstable" and rng.random() < 0.5:
        return replace(s, sm_clock_mhz=_clock(rng, 900, 1095), clocks_event_reasons=0, power_w=_watts(rng, 100, 140))
    return s


def _nvlink(s: GpuSample, down: int = 0, crc: int = 0) -> GpuSample:
    """`s` on a GPU with 18 NVLinks, `down` of them inactive, `crc` CRC errors so far."""
    return replace(s, nvlink_links_down=down, nvlink_crc_errors=crc, nvlink_recovery_errors=0)


_LINK_FAULTS: dict[str, Callable[[GpuSample, int], GpuSample]] = {
    "recovery_action": lambda s, n: replace(s, recovery_action=1),
    "pcie_x8": lambda s, n: replace(s, pcie_link_width=8),
    "pcie_errors": lambda s, n: replace(s, pcie_correctable_errors=(s.pcie_correctable_errors or 0) + n),
    "nvlink_down": lambda s, n: _nvlink(s, down=1),
    "nvlink_errors": lambda s, n: _nvlink(s, crc=n),
    "fabric_not_ready": lambda s, n: replace(s, fabric_state=2, fabric_status=0),
}


def _watts(rng: random.Random, low: float, high: float) -> float:
    return round(rng.uniform(low, high), 3)
