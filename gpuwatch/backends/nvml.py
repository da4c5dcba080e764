"""The NVML backend: reads each GPU through pynvml with the cheapest call per field.

pynvml is imported lazily in open() (or injected as a module-shaped object for tests), so
importing this module never needs a driver. Every pynvml exception is mapped once, in
`_map_error`, into `gpuwatch.errors`; nothing above this module sees an NVMLError.

Costs measured on an H200 (docs/performance.md §Peers on the same H200) decide which call reads what:
the per-sample fields cost about 60 µs per GPU in all, while PCIe replays (170 µs), violation counters
(0.64 ms) and energy (3.1 ms) are read only when the caller asks for a slow sample, and max clocks
(1.5 ms) only at open.
Of the per-sample reads, those a rule judges over a long window or that change only after a fault seen
at once (PCIe link, ECC aggregates, row remapping, the process list) follow the read plan (nvml_plan.py).

The event set follows `nvml.events` (event_kinds below): by default a GPU whose XIDs the kernel log
already delivers (kmsg.py) gets none, as a registered set was the prime suspect of the job's slowdown
on an H200 (docs/events.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import operator
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.backends import nvml_calls, nvml_plan
from gpuwatch.backends.nvml_plan import ReadPlan
from gpuwatch.config import Config
from gpuwatch.errors import BackendUnavailable, GpuReadError
from gpuwatch.model import SAMPLE_FIELDS as SAMPLE_FIELD_NAMES
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic

log = logging.getLogger("gpuwatch.backends.nvml")

# ref. nvml.h nvmlValueType_t: the member of nvmlValue_t that holds a field value, by valueType.
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
# ref. nvml.h NVML_PSTATE_UNKNOWN: P0–P15 are real states, 32 means the driver does not know.
_MAX_PSTATE = 15
# Events already queued when a wait returns are drained without blocking, up to this many.
_MAX_EVENTS_PER_WAIT = 64
# The field values read in one nvmlDeviceGetFieldValues call: every sample, and on slow samples (links).
SAMPLE_FIELDS = (
    ("NVML_FI_DEV_MEMORY_TEMP", "mem_temp_c"),
    ("NVML_FI_DEV_POWER_INSTANT", "power_instant_mw"),
)
# The driver's recovery action, a field of its own: the read plan reads it (nvml_plan.py).
RECOVERY_FIELD = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
LINK_FIELDS = (
    ("NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS", "pcie_correctable_errors"),
    ("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "nvlink_crc_errors"),
    ("NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "nvlink_recovery_errors"),
)
# The read plan's groups (nvml_plan.py) → the reads each makes when due, and the sample fields they fill.
# The reads every sample makes, by key: a sample field's name, or util, memory, power and pstate, which
# sample() converts.
_EVERY = (
    "util",
    "memory",
    "power",
    "pstate",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "temp_c",
    "clocks_event_reasons",
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
)
_TIERS = {
    "recovery": ("recovery_action",),
    "remapped": ("remapped",),
    "ecc_aggregate": ("ecc_sbe_aggregate", "ecc_dbe_aggregate"),
    "pcie_gen": ("pcie_link_gen",),
    "pcie_width": ("pcie_link_width",),
}
_REMAPPED = ("remapped_cor", "remapped_unc", "remapped_pending", "remapped_failure")
# Every sample field, None until read, and all of them in GpuSample's order.
_NO_VALUES: dict[str, Any] = dict.fromkeys(SAMPLE_FIELD_NAMES)
_IN_ORDER = operator.itemgetter(*SAMPLE_FIELD_NAMES)
# nvml.events → the event kinds registered on a GPU (auto: see event_kinds).
_EVENT_KINDS: dict[str, tuple[str, ...]] = {"all": ("xid", "ecc_dbe", "ecc_sbe"), "xid": ("xid",), "none": ()}


def event_kinds(mode: str, kernel_log: bool) -> tuple[str, ...]:
    """The NVML event kinds to register on one GPU under `nvml.events = mode`.

    auto: none where the kernel log covers the GPU (`kernel_log`), which delivers each XID as it is
    written; XID events elsewhere. Either way a double-bit ECC error is judged at once through the
    XID the driver logs with it (48, 94, 95) and at the next sample through the ECC counters, and
    single-bit errors, judged by their rate over an hour, through the counters read every sample.
    """
    if mode == "auto":
        mode = "none" if kernel_log else "xid"
    return _EVENT_KINDS[mode]


@dataclass
class _Gpu:
    """One NVML device as this backend tracks it: handle, static facts, fields found unsupported."""

    index: int
    static: GpuStatic
    handle: Any = None
    error: GpuReadError | None = None
    unsupported: set[str] = field(default_factory=set)
    nvlinks: int = 0  # NVLinks found at open (0: a PCIe-only card, nothing NVLink is read)
    reads: dict[str, Callable[[], Any]] = field(default_factory=dict)  # each read → its call (_bind_reads)
    every: tuple[tuple[str, Callable[[], Any]], ...] = ()  # the reads every sample makes, by key
    tier_reads: dict[str, tuple[tuple[str, Callable[[], Any]], ...]] = field(default_factory=dict)  # read plan's
    tiers: dict[str, float] = field(default_factory=dict)  # read-plan group → when it was last read
    tier_values: dict[str, Any] = field(default_factory=dict)  # the sample fields the groups read last
    tiers_fresh: tuple[float, float] = (math.inf, -math.inf)  # from and until when no group is due
    listed: tuple[float, tuple[int, ...] | None] | None = None  # when the process list was read, and what it held
    counted_at: int | None = None  # the memory in use when the processes were last counted or listed
    # The bound per-sample field batch: how many reads were unsupported when it was bound, its fields, its call.
    fields: tuple[int, tuple[str, ...], Callable[[], Any] | None] = (-1, (), None)
    last_slow: dict[str, Any] = field(default_factory=dict)  # what the last slow sample read, repeated until the next


class NvmlBackend:
    """Reads GPUs through NVML (nvidia-ml-py). Constructed cheaply; nothing is touched until open().

    Beyond the Backend protocol it offers `release_handles()` and `reacquire()`, so a reset drill
    can let go of NVML (a GPU reset fails while any client holds it) and pick it up afterwards.

    Args:
        config: the daemon's configuration (NVML needs none of it; kept for the Backend contract).
        nvml: a module-shaped object with pynvml's names, for tests; None imports pynvml in open().
        plan: how often the tiered per-sample reads are made (nvml_plan.py).
    """

    name = "nvml"

    def __init__(self, config: Config, nvml: Any = None, plan: ReadPlan = nvml_plan.DEFAULT) -> None:
        self._config = config
        self._nvml: Any = nvml
        self._plan = plan
        groups = {
            "recovery": plan.recovery_s,
            "remapped": plan.remapped_s,
            "ecc_aggregate": plan.ecc_aggregate_s,
            "pcie_gen": plan.pcie_gen_s,
            "pcie_width": plan.pcie_width_s,
        }
        # The read plan's groups and their periods (a recovery action read every sample is in the batch instead).
        self._groups = tuple((group, s) for group, s in groups.items() if group != "recovery" or s > 0)
        self._vendor_errors: tuple[type[BaseException], ...] = ()
        self._unsupported_codes: frozenset[int] = frozenset()
        self._field_ids: tuple[tuple[int, str], ...] = ()
        self._slow_field_ids: tuple[tuple[int, str], ...] = ()
        self._event_kinds: tuple[tuple[int, str], ...] = ()
        self._gpus: list[_Gpu] = []
        self._initialized = False
        # Guards init state and the event set; wait_events holds it while blocked in NVML, so
        # close() and release_handles() wait for an in-flight wait to return.
        self._lock = threading.Lock()
        self._event_set: Any = None
        self._registered: dict[Hashable, _Gpu] = {}
        self._events_unavailable = False
        self._events_unneeded = False  # nvml.events asks for no set on any GPU: the kernel log covers them
        self._kernel_log_gpus: frozenset[int] = frozenset()
        self._lost: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> tuple[GpuStatic, ...]:
        """Initialise NVML and read each GPU's static facts once.

        A GPU that fails at this point still gets a GpuStatic (empty uuid) so its index is known;
        sample() then reports the failure for it, and the other GPUs read normally.

        Raises:
            BackendUnavailable: pynvml is missing, NVML does not initialise, or it finds no GPU.
        """
        nvml = self._load()
        try:
            nvml.nvmlInit()
        except self._vendor_errors as exc:
            raise BackendUnavailable(f"NVML did not initialise: {exc}") from None
        try:
            count = nvml.nvmlDeviceGetCount()
        except self._vendor_errors as exc:
            self._quiet_shutdown()
            raise BackendUnavailable(f"NVML could not count GPUs: {exc}") from None
        if count == 0:
            self._quiet_shutdown()
            raise BackendUnavailable("NVML found no GPU")
        with self._lock:
            self._initialized = True
            self._events_unavailable = self._events_unneeded = False
            self._lost = set()
            self._gpus = [self._discover(index) for index in range(count)]
        return tuple(gpu.static for gpu in self._gpus)

    def close(self) -> None:
        """Free the event set and shut NVML down. Safe to call twice."""
        self.release_handles()

    def release_handles(self) -> None:
        """Let go of every NVML handle (nvmlShutdown) so a GPU reset can proceed. Safe to call twice.

        Until reacquire(), sample() raises GpuReadError and wait_events() returns no events.
        """
        with self._lock:
            self._free_event_set()
            for gpu in self._gpus:
                gpu.handle = None
            if self._initialized:
                self._initialized = False
                self._quiet_shutdown()

    def reacquire(self) -> tuple[GpuStatic, ...]:
        """Initialise NVML again after release_handles() and re-read the static facts.

        Handles and even indices can change across a reset, so everything is looked up afresh.

        Raises:
            BackendUnavailable: NVML does not come back.
        """
        self.release_handles()
        return self.open()

    # -- sampling ----------------------------------------------------------------------------

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        """Read one GPU. `slow` also reads PCIe replays, violation counters, energy and the links; other samples
        repeat what the last slow one read.

        Args:
            index: the NVML index of the GPU.
            now: the sample's timestamp (Unix seconds), supplied by the caller.
            slow: read the costly fields too; otherwise they repeat the last slow reading (None before one).

        Raises:
            GpuReadError: this GPU failed (kind gpu_lost, reset_required or unknown).
        """
        gpu = self._gpu(index)
        try:
            got = self._read_all(gpu, gpu.every)
            got.update(self._sample_fields(gpu))
            if slow or not gpu.tiers_fresh[0] <= now < gpu.tiers_fresh[1]:
                self._read_tiers(gpu, now, slow)
            memory = got["memory"]  # the bound call's buffer: read at once
            used = None if memory is None else int(memory.used)
            pids = self._pids(gpu, used, now, slow)
            if slow:
                gpu.last_slow = {**self._read_slow(gpu, gpu.handle), **self._read_links(gpu, gpu.handle)}
        except self._vendor_errors as exc:
            raise _map_error(self._nvml, exc) from exc
        util, power_mw, pstate = got["util"], got["power"], got["pstate"]
        pstate = pstate if pstate is not None and pstate <= _MAX_PSTATE else None
        # The costly counters, link counters and link states are read on slow samples; every sample repeats
        # the last reading, so every scrape has each series (rate() over them works) and link rates and
        # states are judged over windows shorter than slow_interval_s.
        values = {**_NO_VALUES, **got, **gpu.tier_values, **gpu.last_slow, "pstate": pstate}
        values.update(
            t=now,
            index=gpu.index,
            uuid=gpu.static.uuid,
            power_w=None if power_mw is None else power_mw / 1000.0,
            util_gpu_pct=None if util is None else util.gpu,
            util_mem_pct=None if util is None else util.memory,
            memory_used_bytes=used,
            pids=() if pids is None else pids,
        )
        return GpuSample(*_IN_ORDER(values))  # by position: a third cheaper than by keyword for its 36 fields

    def _read_all(self, gpu: _Gpu, reads: tuple[tuple[str, Callable[[], Any]], ...]) -> dict[str, Any]:
        """Each read by its key, as _read makes them, in one loop (the reads every sample makes)."""
        unsupported, values = gpu.unsupported, dict[str, Any]()
        for key, call in reads:
            if key in unsupported:
                values[key] = None
                continue
            try:
                values[key] = call()
            except self._vendor_errors as exc:
                self._failed(gpu, key, exc)
                values[key] = None
        return values

    def _read_tiers(self, gpu: _Gpu, now: float, slow: bool) -> None:
        """Read the plan's groups that are due (nvml_plan.due), and note until when none will be."""
        fresh_from, fresh_until = -math.inf, math.inf
        for group, period_s in self._groups:
            last = gpu.tiers.get(group)
            if last is None or nvml_plan.due(last, now, period_s, slow):
                gpu.tier_values.update(self._tier_values(group, self._read_all(gpu, gpu.tier_reads[group])))
                gpu.tiers[group] = last = now
            fresh_from, fresh_until = max(fresh_from, last), min(fresh_until, last + period_s)
        gpu.tiers_fresh = (fresh_from, fresh_until)

    @staticmethod
    def _tier_values(group: str, read: dict[str, Any]) -> dict[str, Any]:
        """Sample fields from a group's reads: row remapping's four outputs, each of the others as it is."""
        if group != "remapped":
            return read
        # ref. nvml.h nvmlDeviceGetRemappedRows: (corrRows, uncRows, isPending, failureOccurred).
        remapped = read["remapped"]
        return dict(zip(_REMAPPED, (None,) * 4 if remapped is None else remapped, strict=True))

    def _pids(self, gpu: _Gpu, memory_used: int | None, now: float, slow: bool) -> tuple[int, ...] | None:
        """The compute processes on the GPU; by the plan, counted only when the memory in use moved (a process
        that starts or ends moves it: its CUDA context lives there), listed only when the count changed (or due).

        A count that cannot be read (a binding or driver without it) is remembered as unsupported, and
        the list is then read every sample, as before the plan.
        """
        plan = self._plan
        listed = gpu.listed
        if plan.pids_by_count and listed is not None and listed[1] is not None:
            if not nvml_plan.due(listed[0], now, plan.pids_list_s, slow):
                pids: tuple[int, ...] = listed[1]
                if memory_used is not None and memory_used == gpu.counted_at:
                    return pids
                count = self._read(gpu, "pids_count", gpu.reads["pids_count"])
                gpu.counted_at = memory_used
                if count == len(pids):
                    return pids
        procs = self._read(gpu, "pids", self._nvml.nvmlDeviceGetComputeRunningProcesses, gpu.handle)
        found = None if procs is None else tuple(proc.pid for proc in procs)
        gpu.listed, gpu.counted_at = (now, found), memory_used
        return found

    def _read_slow(self, gpu: _Gpu, handle: Any) -> dict[str, Any]:
        """The costly counters (docs/performance.md: PCIe 0.17 ms, violations 0.64, energy 3.1): slow samples only."""
        nvml = self._nvml
        read = functools.partial(self._read, gpu)
        # ref. nvml.h nvmlViolationTime_t: violationTime is in nanoseconds.
        power = read("violation_power", nvml.nvmlDeviceGetViolationStatus, handle, nvml.NVML_PERF_POLICY_POWER)
        thermal = read("violation_thermal", nvml.nvmlDeviceGetViolationStatus, handle, nvml.NVML_PERF_POLICY_THERMAL)
        return {
            "pcie_replay": read("pcie_replay", nvml.nvmlDeviceGetPcieReplayCounter, handle),
            "violation_power_ns": None if power is None else power.violationTime,
            "violation_thermal_ns": None if thermal is None else thermal.violationTime,
            "energy_mj": read("energy", nvml.nvmlDeviceGetTotalEnergyConsumption, handle),
        }

    def _read_links(self, gpu: _Gpu, handle: Any) -> dict[str, Any]:
        """PCIe correctable errors, NVLink error counters and states, fabric state: the slow link readings."""
        nvml = self._nvml
        links = self._read_field_values(gpu, handle, self._slow_field_ids)
        if gpu.nvlinks:
            states = [
                self._read(gpu, "nvlink_state", nvml.nvmlDeviceGetNvLinkState, handle, n) for n in range(gpu.nvlinks)
            ]
            if all(state is not None for state in states):
                links["nvlink_links_down"] = sum(state != nvml.NVML_FEATURE_ENABLED for state in states)
        fabric = self._read(gpu, "fabric", self._fabric_info, handle)
        if fabric is not None:
            links["fabric_state"], links["fabric_status"] = fabric
        return links

    def _fabric_info(self, handle: Any) -> tuple[int, int] | None:
        """(state, status) of the GPU's NVSwitch fabric registration; None where there is no fabric."""
        nvml = self._nvml
        info_type = getattr(nvml, "c_nvmlGpuFabricInfo_t", None)
        if info_type is None:  # a binding older than fabric info
            return None
        info = info_type()
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
        if info.state == getattr(nvml, "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED", 0):
            return None
        return int(info.state), int(info.status)

    def _sample_fields(self, gpu: _Gpu) -> dict[str, Any]:
        """The per-sample field values through the batch bound for them (bound again once a field turns out
        unsupported), or pynvml's wrapper where none binds."""
        unsupported, names, read = gpu.fields
        if unsupported != len(gpu.unsupported):
            wanted = [(field_id, name) for field_id, name in self._field_ids if name not in gpu.unsupported]
            names = tuple(name for _, name in wanted)
            read = nvml_calls.bind_field_values(self._nvml, gpu.handle, [f for f, _ in wanted]) if wanted else None
            gpu.fields = (len(gpu.unsupported), names, read)
        if read is None:
            return self._read_field_values(gpu, gpu.handle, self._field_ids)
        results = self._read(gpu, "field_values", read)
        return {} if results is None else self._field_results(gpu, names, results)

    def _field(self, handle: Any, field_id: int) -> int:
        """One field through pynvml's wrapper (where no batch binds); its own NVML return other than success raises."""
        nvml = self._nvml
        (result,) = nvml.nvmlDeviceGetFieldValues(handle, [field_id])
        if result.nvmlReturn != nvml.NVML_SUCCESS:
            raise nvml.NVMLError(result.nvmlReturn)
        return int(getattr(result.value, _VALUE_MEMBERS[result.valueType]))

    def _read_field_values(self, gpu: _Gpu, handle: Any, field_ids: tuple[tuple[int, str], ...]) -> dict[str, Any]:
        """Several fields in one nvmlDeviceGetFieldValues call through pynvml's wrapper (on slow samples: the
        link error counters; every sample where the batch cannot be bound).

        One or two fields cost 5–8 µs, so this is the cheapest path for them; a field the GPU
        lacks is cached as unsupported like any other (ref. nvmlFieldValue_t.nvmlReturn).
        """
        nvml = self._nvml
        wanted = [(field_id, name) for field_id, name in field_ids if name not in gpu.unsupported]
        if not wanted:
            return {}
        results = self._read(gpu, "field_values", nvml.nvmlDeviceGetFieldValues, handle, [f for f, _ in wanted])
        if results is None:
            return {}
        decoded = [
            (r.nvmlReturn, getattr(r.value, _VALUE_MEMBERS[r.valueType]) if r.nvmlReturn == nvml.NVML_SUCCESS else None)
            for r in results
        ]
        return self._field_results(gpu, tuple(name for _, name in wanted), decoded)

    def _field_results(self, gpu: _Gpu, names: tuple[str, ...], results: nvml_calls.FieldResults) -> dict[str, Any]:
        """Each field's value by name; a field the GPU lacks is marked unsupported, a lost GPU raises."""
        nvml = self._nvml
        values: dict[str, Any] = {}
        for name, (code, value) in zip(names, results, strict=True):
            if code == nvml.NVML_SUCCESS:
                values[name] = int(value)  # type: ignore[arg-type]  # a success always carries a value
            elif code in self._unsupported_codes:
                self._mark_unsupported(gpu, name)
            elif code in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED):
                raise nvml.NVMLError(code)
            else:
                log.debug("GPU %d: field %s not read this time (NVML return %d)", gpu.index, name, code)
        return values

    # -- events ------------------------------------------------------------------------------

    def kernel_log_covers(self, indices: Collection[int]) -> None:
        """The GPUs whose XIDs the kernel log delivers as they happen (the daemon says so before its first wait).

        Under `nvml.events = auto` those GPUs get no event set. A set already registered is freed, so
        the next wait registers what the setting now asks for.
        """
        with self._lock:
            self._kernel_log_gpus = frozenset(indices)
            self._free_event_set()
            self._events_unneeded = False

    def wait_events(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        """Block up to `timeout_s` for XID / ECC events from NVML's event set.

        The set is created on the first call, registered per GPU for the kinds `nvml.events` asks of
        it (event_kinds) that the GPU supports. Where no GPU needs one, or none supports what it
        needs, this logs once and sleeps. A GPU that falls off the bus while waiting comes back as a
        GpuError (kind gpu_lost).
        """
        with self._lock:
            if self._initialized and self._ensure_event_set():
                return self._wait(timeout_s)
        time.sleep(max(0.0, timeout_s))
        return []

    def _ensure_event_set(self) -> bool:
        """Create and register the event set unless it exists, no GPU needs one, or events are unavailable."""
        if self._event_set is not None:
            return True
        if self._events_unavailable or self._events_unneeded:
            return False
        gpus = [gpu for gpu in self._gpus if gpu.handle is not None and gpu.index not in self._lost]
        masks = {gpu.index: self._event_mask(gpu.index) for gpu in gpus}
        if not any(masks.values()):
            return self._no_set_needed(gpus)
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except self._vendor_errors as exc:
            return self._no_events(f"nvmlEventSetCreate failed: {exc}")
        registered: dict[Hashable, _Gpu] = {}
        for gpu in gpus:
            wanted = masks[gpu.index]
            if not wanted:
                continue
            try:
                # ref. nvml.h nvmlDeviceRegisterEvents: registering an unsupported type fails the call,
                # so ask which types this GPU supports first.
                mask = nvml.nvmlDeviceGetSupportedEventTypes(gpu.handle) & wanted
                if mask:
                    nvml.nvmlDeviceRegisterEvents(gpu.handle, mask, event_set)
                    registered[_handle_key(gpu.handle)] = gpu
            except self._vendor_errors as exc:
                log.warning("GPU %d: NVML event registration failed: %s", gpu.index, exc)
        if not registered:
            self._free(event_set)
            return self._no_events("no GPU supports XID or ECC events")
        self._event_set, self._registered = event_set, registered
        return True

    def _event_mask(self, index: int) -> int:
        """The NVML event types `nvml.events` asks of GPU `index` (0: no set for it)."""
        kinds = event_kinds(self._config.nvml.events, index in self._kernel_log_gpus)
        mask = 0
        for bit, kind in self._event_kinds:
            if kind in kinds:
                mask |= bit
        return mask

    def _no_set_needed(self, gpus: list[_Gpu]) -> bool:
        """No GPU needs an NVML event set: say where their XIDs come from instead, once."""
        self._events_unneeded = True
        mode = self._config.nvml.events
        blind = [gpu.index for gpu in gpus if gpu.index not in self._kernel_log_gpus]
        if blind:
            log.warning("nvml.events = %s and no kernel log for GPU(s) %s: their XIDs are not seen", mode, blind)
        else:
            log.info("no NVML event set (nvml.events = %s): XIDs come from the kernel log", mode)
        return False

    def _no_events(self, reason: str) -> bool:
        self._events_unavailable = True
        log.warning("NVML events unavailable (%s): XIDs and ECC errors are not seen as they happen", reason)
        return False

    def _wait(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        """One blocking nvmlEventSetWait_v2, then drain whatever else already arrived."""
        nvml = self._nvml
        items: list[GpuEvent | GpuError] = []
        timeout_ms = max(0, int(timeout_s * 1000))
        for _ in range(_MAX_EVENTS_PER_WAIT):
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
            except self._vendor_errors as exc:
                code = getattr(exc, "value", None)
                if code == nvml.NVML_ERROR_GPU_IS_LOST:
                    items.extend(self._find_lost(exc, timeout_s))
                elif code != nvml.NVML_ERROR_TIMEOUT:
                    # Not a reading of any one GPU: log it and pace the caller's loop.
                    log.warning("nvmlEventSetWait_v2 failed: %s", exc)
                    if not items:
                        time.sleep(max(0.0, timeout_s))
                break
            event = self._to_event(data)
            if event is not None:
                items.append(event)
            timeout_ms = 0
        return items

    def _to_event(self, data: Any) -> GpuEvent | None:
        """Map nvmlEventData_t to a GpuEvent; the device is matched by its handle."""
        gpu = self._registered.get(_handle_key(data.device))
        kind = next((name for bit, name in self._event_kinds if data.eventType & bit), None)
        if gpu is None or kind is None:
            log.debug("ignoring NVML event type %#x for an unknown device or type", data.eventType)
            return None
        # ref. nvml.h nvmlEventData_t: for XIDs eventData is the XID number (999 when unknown).
        xid = int(data.eventData) if kind == "xid" else None
        return GpuEvent(t=time.time(), index=gpu.index, uuid=gpu.static.uuid, kind=kind, xid=xid)

    def _find_lost(self, exc: BaseException, timeout_s: float) -> list[GpuEvent | GpuError]:
        """The wait said a GPU is lost but not which one: probe each, and drop the lost ones from the set."""
        now = time.time()
        lost: list[_Gpu] = []
        for gpu in self._registered.values():
            try:
                with self._mapped():
                    self._nvml.nvmlDeviceGetPerformanceState(gpu.handle)
            except GpuReadError as err:
                if err.kind == "gpu_lost":
                    lost.append(gpu)
        # The next wait re-registers the GPUs still there; a lost one would fail every wait.
        self._free_event_set()
        self._lost.update(gpu.index for gpu in lost)
        if not lost:
            log.warning("NVML event wait reports a lost GPU (%s) but every GPU still answers", exc)
            time.sleep(max(0.0, timeout_s))
        return [GpuError(t=now, index=g.index, uuid=g.static.uuid, kind="gpu_lost", detail=str(exc)) for g in lost]

    def _free_event_set(self) -> None:
        if self._event_set is not None:
            self._free(self._event_set)
        self._event_set, self._registered = None, {}

    def _free(self, event_set: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except self._vendor_errors as exc:
            log.debug("nvmlEventSetFree failed: %s", exc)

    # -- helpers -----------------------------------------------------------------------------

    def _load(self) -> Any:
        """The pynvml module (imported on first use) and the names this backend derives from it."""
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as exc:
                raise BackendUnavailable(f"pynvml is not importable: {exc}") from None
            self._nvml = pynvml
        nvml = self._nvml
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self._vendor_errors = (nvml.NVMLError,) if mismatch is None else (nvml.NVMLError, mismatch)
        # FUNCTION_NOT_FOUND is a driver older than the binding: as final for this field as NOT_SUPPORTED.
        self._unsupported_codes = frozenset({nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_FUNCTION_NOT_FOUND})
        # A plan that reads the recovery action every sample (BEFORE) reads it in the batch, as releases before it did.
        every = self._plan.recovery_s <= 0
        fields = (*SAMPLE_FIELDS, (RECOVERY_FIELD, "recovery_action")) if every else SAMPLE_FIELDS
        self._field_ids = tuple((getattr(nvml, c), name) for c, name in fields if hasattr(nvml, c))
        self._slow_field_ids = tuple((getattr(nvml, c), name) for c, name in LINK_FIELDS if hasattr(nvml, c))
        self._event_kinds = (
            (nvml.nvmlEventTypeXidCriticalError, "xid"),
            (nvml.nvmlEventTypeDoubleBitEccError, "ecc_dbe"),
            (nvml.nvmlEventTypeSingleBitEccError, "ecc_sbe"),
        )
        return nvml

    def _discover(self, index: int) -> _Gpu:
        """Handle, uuid and the static facts of one GPU; a fact it lacks is None."""
        nvml = self._nvml
        try:
            with self._mapped():
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        except GpuReadError as exc:
            log.warning("GPU %d cannot be read at start (%s); it reports errors until reacquired", index, exc)
            return _Gpu(index=index, static=GpuStatic(index=index, uuid=""), error=exc)
        gpu = _Gpu(index=index, static=GpuStatic(index=index, uuid=uuid), handle=handle)

        def fact(key: str, fn: Callable[..., Any], *args: Any) -> Any:
            try:
                with self._mapped():
                    return self._read(gpu, key, fn, *args)
            except GpuReadError as exc:
                log.warning("GPU %d: static fact %s not read: %s", index, key, exc)
                return None

        threshold = nvml.nvmlDeviceGetTemperatureThreshold
        name = fact("name", nvml.nvmlDeviceGetName, handle)
        pci = fact("pci", nvml.nvmlDeviceGetPciInfo, handle)
        limit_mw = fact("power_limit", nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        memory = fact("memory_total", nvml.nvmlDeviceGetMemoryInfo, handle)
        gpu.static = GpuStatic(
            index=index,
            uuid=uuid,
            name="" if name is None else _text(name),
            pci_bus_id="" if pci is None else _text(pci.busId),
            max_sm_clock_mhz=fact("max_sm_clock", nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_SM),
            max_mem_clock_mhz=fact("max_mem_clock", nvml.nvmlDeviceGetMaxClockInfo, handle, nvml.NVML_CLOCK_MEM),
            # ref. nvml.h nvmlDeviceGetEnforcedPowerLimit: milliwatts, the limit actually in force.
            power_limit_w=None if limit_mw is None else limit_mw / 1000.0,
            memory_total_bytes=None if memory is None else memory.total,
            slowdown_temp_c=fact("slowdown", threshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            shutdown_temp_c=fact("shutdown", threshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN),
            mem_max_temp_c=fact("mem_max", threshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
            gpu_max_temp_c=fact("gpu_max", threshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
            pcie_link_gen_max=fact("pcie_gen_max", nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            pcie_link_width_max=fact("pcie_width_max", nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        )
        gpu.nvlinks = self._count_nvlinks(gpu)
        gpu.reads = reads = self._bind_reads(handle)
        gpu.every = tuple((key, reads[key]) for key in _EVERY)
        gpu.tier_reads = {group: tuple((key, reads[key]) for key in keys) for group, keys in _TIERS.items()}
        return gpu

    def _bind_reads(self, handle: Any) -> dict[str, Callable[[], Any]]:
        """Each per-sample and read-plan call of one GPU, bound once (nvml_calls.py), else pynvml's wrapper."""
        nvml = self._nvml
        corrected, uncorrected = nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        volatile, aggregate = nvml.NVML_VOLATILE_ECC, nvml.NVML_AGGREGATE_ECC
        ull, uint = ctypes.c_ulonglong, ctypes.c_uint
        # read → (the C function, its arguments before the output, the output's type)
        calls: dict[str, tuple[str, tuple[Any, ...], Any]] = {
            "util": ("nvmlDeviceGetUtilizationRates", (), getattr(nvml, "c_nvmlUtilization_t", None)),
            "memory": ("nvmlDeviceGetMemoryInfo", (), getattr(nvml, "c_nvmlMemory_t", None)),
            "power": ("nvmlDeviceGetPowerUsage", (), uint),
            "pstate": ("nvmlDeviceGetPerformanceState", (), uint),
            "sm_clock_mhz": ("nvmlDeviceGetClockInfo", (nvml.NVML_CLOCK_SM,), uint),
            "mem_clock_mhz": ("nvmlDeviceGetClockInfo", (nvml.NVML_CLOCK_MEM,), uint),
            # ref. nvml.h nvmlDeviceGetTemperature: deprecated for ...TemperatureV, which older drivers lack.
            "temp_c": ("nvmlDeviceGetTemperature", (nvml.NVML_TEMPERATURE_GPU,), uint),
            "clocks_event_reasons": ("nvmlDeviceGetCurrentClocksEventReasons", (), ull),
            "ecc_sbe_volatile": ("nvmlDeviceGetTotalEccErrors", (corrected, volatile), ull),
            "ecc_dbe_volatile": ("nvmlDeviceGetTotalEccErrors", (uncorrected, volatile), ull),
            "ecc_sbe_aggregate": ("nvmlDeviceGetTotalEccErrors", (corrected, aggregate), ull),
            "ecc_dbe_aggregate": ("nvmlDeviceGetTotalEccErrors", (uncorrected, aggregate), ull),
            "pcie_link_gen": ("nvmlDeviceGetCurrPcieLinkGeneration", (), uint),
            "pcie_link_width": ("nvmlDeviceGetCurrPcieLinkWidth", (), uint),
        }
        reads: dict[str, Callable[[], Any]] = {}
        for key, (name, args, out) in calls.items():
            wrapper = functools.partial(getattr(nvml, name), handle, *args)
            reads[key] = nvml_calls.bind(nvml, name, handle, *args, out=out) or wrapper
        reads["remapped"] = functools.partial(nvml.nvmlDeviceGetRemappedRows, handle)  # four outputs: the wrapper
        recovery = getattr(nvml, RECOVERY_FIELD, None)
        reads["recovery_action"] = (
            _absent
            if recovery is None
            else nvml_calls.bind_field(nvml, handle, recovery) or functools.partial(self._field, handle, recovery)
        )
        reads["pids_count"] = nvml_plan.bind_process_count(nvml, handle)
        return reads

    def _count_nvlinks(self, gpu: _Gpu) -> int:
        """How many NVLinks the GPU has: links answer in order until the first that is not there."""
        nvml = self._nvml
        count = 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                nvml.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except self._vendor_errors:
                break  # NOT_SUPPORTED on a PCIe-only card (the lab's H200), INVALID_ARGUMENT past the last link
            count += 1
        return count

    def _gpu(self, index: int) -> _Gpu:
        if not self._initialized:
            raise GpuReadError("unknown", "NVML is not open (never opened, closed, or released for a reset)")
        if not 0 <= index < len(self._gpus):
            raise GpuReadError("unknown", f"no GPU with NVML index {index}")
        gpu = self._gpus[index]
        if gpu.error is not None:
            raise GpuReadError(gpu.error.kind, gpu.error.detail)
        return gpu

    def _read(self, gpu: _Gpu, key: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call for field `key`; None if this GPU does not support it (remembered, not retried)."""
        if key in gpu.unsupported:
            return None
        try:
            return fn(*args)
        except self._vendor_errors as exc:
            self._failed(gpu, key, exc)
            return None

    def _failed(self, gpu: _Gpu, key: str, exc: BaseException) -> None:
        """A read of `key` that raised: remembered if the GPU does not support it (the read is None), else raised."""
        # NVMLLibraryMismatchError (no .value) is pynvml's FUNCTION_NOT_FOUND for unversioned calls.
        if getattr(exc, "value", None) not in self._unsupported_codes and hasattr(exc, "value"):
            raise exc
        self._mark_unsupported(gpu, key)

    def _mark_unsupported(self, gpu: _Gpu, key: str) -> None:
        gpu.unsupported.add(key)
        log.debug("GPU %d does not support %s; it will not be read again", gpu.index, key)

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        """Turn any pynvml exception raised inside into a GpuReadError (the one place errors are mapped)."""
        try:
            yield
        except self._vendor_errors as exc:
            raise _map_error(self._nvml, exc) from exc

    def _quiet_shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._vendor_errors as exc:
            log.debug("nvmlShutdown failed: %s", exc)


def _absent() -> None:
    """A read the binding has no name for (an nvidia-ml-py older than the field): never supported."""
    return None


def _map_error(nvml: Any, exc: BaseException) -> GpuReadError:
    """The trace format's error kind for an NVML error (ref. nvml.h nvmlReturn_t)."""
    code = getattr(exc, "value", None)
    if code == nvml.NVML_ERROR_GPU_IS_LOST:
        return GpuReadError("gpu_lost", str(exc))
    if code == nvml.NVML_ERROR_RESET_REQUIRED:
        return GpuReadError("reset_required", str(exc))
    return GpuReadError("unknown", str(exc))


def _handle_key(handle: Any) -> Hashable:
    """A key equal for every handle of one device.

    pynvml returns a new ctypes pointer object per call (nvmlEventData_t.device included), so real
    handles are keyed by the address they hold; any other object (a test fake) is its own key.
    """
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return handle


def _text(value: str | bytes) -> str:
    """pynvml returns str for most strings but bytes for struct members (nvmlPciInfo_t.busId)."""
    return value.decode() if isinstance(value, bytes) else value
