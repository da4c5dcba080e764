"""A module-shaped fake of pynvml for NvmlBackend tests, injected as `NvmlBackend(config, nvml=FakeNvml())`.

It has the names pynvml has (NVMLError with `.value`, the NVML_* constants, nvml* functions) for the
subset gpuwatch calls, per-GPU values in real units, per-function NOT_SUPPORTED or other errors,
a whole GPU that fails every call (fallen off the bus), queued events, and a count of every call
so tests can prove which calls a code path makes. test_nvml.py checks the constants and function
names against the installed pynvml, so the fake cannot drift from the real binding unnoticed.
"""

from __future__ import annotations

import ctypes
import functools
from collections import Counter, deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_UNKNOWN = 999

NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_TEMPERATURE_GPU = 0
NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
NVML_TEMPERATURE_THRESHOLD_MEM_MAX = 2
NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1
NVML_PSTATE_UNKNOWN = 32
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_FI_DEV_POWER_INSTANT = 186
NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS = 173
NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL = 38
NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL = 59
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_NVLINK_MAX_LINKS = 36
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_COMPLETED = 3

# The name under which `calls` counts the process count (the C call the list makes first, without a buffer).
PROCESS_COUNT = "nvmlDeviceGetComputeRunningProcesses_v3 (count)"

nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypePState = 0x4
nvmlEventTypeXidCriticalError = 0x8

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """pynvml's error: the NVML return code is `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML error {self.value}")


@dataclass(frozen=True)
class FakeHandle:
    """A device handle. Equal by index, like real handles are equal by the address they hold."""

    index: int


@dataclass
class FakeEventSet:
    """An event set: which event types each GPU index is registered for."""

    masks: dict[int, int] = field(default_factory=dict)
    freed: bool = False


@dataclass
class FakeGpu:
    """One fake GPU, in NVML's own units (mW, MHz, bytes, ns, mJ). Defaults are an H200 under load.

    `unsupported` names functions (or `field:<id>` for a field value) that answer NOT_SUPPORTED;
    `errors` maps a function name to the NVML error it raises; `fail_all` makes every call raise.
    """

    uuid: str = "GPU-cc1b419f-1257-3993-729d-08492b313adb"
    name: str = "NVIDIA H200"
    pci_bus_id: str = "00000000:00:06.0"
    max_clocks: dict[int, int] = field(default_factory=lambda: {NVML_CLOCK_SM: 1980, NVML_CLOCK_MEM: 3201})
    power_limit_mw: int = 700000
    memory_total: int = 150754820096
    memory_used: int = 644939776
    thresholds: dict[int, int] = field(
        default_factory=lambda: {
            NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: 95,
            NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89,
            NVML_TEMPERATURE_THRESHOLD_MEM_MAX: 95,
            NVML_TEMPERATURE_THRESHOLD_GPU_MAX: 87,
        }
    )
    clocks: dict[int, int] = field(default_factory=lambda: {NVML_CLOCK_SM: 1425, NVML_CLOCK_MEM: 3201})
    power_mw: int = 690123
    temp_c: int = 61
    util: tuple[int, int] = (100, 45)
    reasons: int = 0x4
    pstate: int = 0
    ecc: dict[tuple[int, int], int] = field(
        default_factory=lambda: {
            (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_VOLATILE_ECC): 1,
            (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC): 2,
            (NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_AGGREGATE_ECC): 3,
            (NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC): 4,
        }
    )
    remapped: tuple[int, int, int, int] = (5, 6, 0, 1)
    pids: tuple[int, ...] = (4242, 4243)
    fields: dict[int, tuple[int, int]] = field(
        default_factory=lambda: {
            NVML_FI_DEV_MEMORY_TEMP: (NVML_VALUE_TYPE_UNSIGNED_INT, 66),
            NVML_FI_DEV_POWER_INSTANT: (NVML_VALUE_TYPE_UNSIGNED_INT, 689500),
            NVML_FI_DEV_GET_GPU_RECOVERY_ACTION: (NVML_VALUE_TYPE_UNSIGNED_INT, 0),
            NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS: (NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0),
        }
    )
    pcie_link: tuple[int, int] = (5, 16)  # current generation, width
    pcie_link_max: tuple[int, int] = (5, 16)
    nvlink_states: tuple[int, ...] = ()  # () : a PCIe-only card (NOT_SUPPORTED on link 0), as the lab's H200
    fabric: tuple[int, int] | None = None  # (state, status); None: no fabric (state NOT_SUPPORTED)
    pcie_replay: int = 7
    violations_ns: dict[int, int] = field(
        default_factory=lambda: {NVML_PERF_POLICY_POWER: 61100084832, NVML_PERF_POLICY_THERMAL: 12}
    )
    energy_mj: int = 47746405
    supported_events: int = nvmlEventTypeXidCriticalError | nvmlEventTypeDoubleBitEccError
    unsupported: set[str] = field(default_factory=set)
    errors: dict[str, int] = field(default_factory=dict)
    fail_all: int | None = None


def two_gpus() -> list[FakeGpu]:
    """Two H200s with distinct identities."""
    return [
        FakeGpu(),
        FakeGpu(uuid="GPU-5fa0c5b1-1d2e-4c7a-9a51-0c1b2d3e4f50", pci_bus_id="00000000:00:07.0", pids=()),
    ]


class c_nvmlGpuFabricInfo_t(ctypes.Structure):  # noqa: N801 (pynvml's name)
    _fields_ = [("status", ctypes.c_uint), ("state", ctypes.c_uint8)]


# The structures the bound calls fill (gpuwatch/backends/nvml_calls.py), laid out as pynvml's (test_nvml.py checks).
class c_nvmlUtilization_t(ctypes.Structure):  # noqa: N801 (pynvml's name)
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class c_nvmlMemory_t(ctypes.Structure):  # noqa: N801 (pynvml's name)
    _fields_ = [("total", ctypes.c_ulong), ("free", ctypes.c_ulong), ("used", ctypes.c_ulong)]


class c_nvmlValue_t(ctypes.Union):  # noqa: N801 (pynvml's name)
    _fields_ = [
        ("dVal", ctypes.c_double),
        ("uiVal", ctypes.c_uint),
        ("ulVal", ctypes.c_ulong),
        ("ullVal", ctypes.c_ulong),
        ("sllVal", ctypes.c_long),
        ("siVal", ctypes.c_int),
        ("usVal", ctypes.c_ushort),
    ]


class c_nvmlFieldValue_t(ctypes.Structure):  # noqa: N801 (pynvml's name)
    _fields_ = [
        ("fieldId", ctypes.c_uint),
        ("scopeId", ctypes.c_uint),
        ("timestamp", ctypes.c_long),
        ("latencyUsec", ctypes.c_long),
        ("valueType", ctypes.c_uint),
        ("nvmlReturn", ctypes.c_uint),
        ("value", c_nvmlValue_t),
    ]


_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class FakeNvml:
    """The fake module. Tests configure `gpus`, `init_error`, `wait_error` and queue events."""

    NVMLError = NVMLError
    c_nvmlGpuFabricInfo_t = c_nvmlGpuFabricInfo_t
    c_nvmlUtilization_t = c_nvmlUtilization_t
    c_nvmlMemory_t = c_nvmlMemory_t
    c_nvmlFieldValue_t = c_nvmlFieldValue_t

    def __init__(self, gpus: list[FakeGpu] | None = None) -> None:
        self.gpus = two_gpus() if gpus is None else gpus
        self.calls: Counter[str] = Counter()
        self.init_error: int | None = None
        self.wait_error: int | None = None
        self.initialized = 0
        self.event_sets: list[FakeEventSet] = []
        self.waits: list[int] = []
        self._events: deque[tuple[int, int, int]] = deque()
        # pynvml's table of C functions answers for the calls a sample binds (False: a binding or driver
        # without them, where every read goes through the wrappers); the process count answers either way.
        self.c_table = True

    def __getattr__(self, name: str) -> Any:
        """Module constants (NVML_*, nvmlEventType*) are read as attributes, as on pynvml."""
        value = globals().get(name)
        if value is None or not (name.startswith("NVML_") or name.startswith("nvmlEventType")):
            raise AttributeError(name)
        return value

    def queue_event(self, index: int, event_type: int, data: int = 0) -> None:
        """Make the next wait deliver an event for GPU `index` (if registered for that type)."""
        self._events.append((index, event_type, data))

    def _device(self, fn: str, handle: FakeHandle) -> FakeGpu:
        """Count the call and raise whatever this GPU is configured to raise for it."""
        self.calls[fn] += 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle.index]
        code = gpu.fail_all if gpu.fail_all is not None else gpu.errors.get(fn)
        if code is None and fn in gpu.unsupported:
            code = NVML_ERROR_NOT_SUPPORTED
        if code is not None:
            raise NVMLError(code)
        return gpu

    # library

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        self.initialized -= 1

    def nvmlDeviceGetCount(self) -> int:
        self.calls["nvmlDeviceGetCount"] += 1
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        handle = FakeHandle(index)
        self._device("nvmlDeviceGetHandleByIndex", handle)
        return handle

    # static facts

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._device("nvmlDeviceGetUUID", handle).uuid

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._device("nvmlDeviceGetName", handle).name

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> SimpleNamespace:
        # The real busId is a c_char array member: bytes, not str.
        return SimpleNamespace(busId=self._device("nvmlDeviceGetPciInfo", handle).pci_bus_id.encode())

    def nvmlDeviceGetMaxClockInfo(self, handle: FakeHandle, clock: int) -> int:
        return self._device("nvmlDeviceGetMaxClockInfo", handle).max_clocks[clock]

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_mw

    def nvmlDeviceGetTemperatureThreshold(self, handle: FakeHandle, threshold: int) -> int:
        gpu = self._device("nvmlDeviceGetTemperatureThreshold", handle)
        if threshold not in gpu.thresholds:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.thresholds[threshold]

    # per-sample

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> SimpleNamespace:
        gpu = self._device("nvmlDeviceGetMemoryInfo", handle)
        return SimpleNamespace(total=gpu.memory_total, used=gpu.memory_used, free=gpu.memory_total - gpu.memory_used)

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock: int) -> int:
        return self._device("nvmlDeviceGetClockInfo", handle).clocks[clock]

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetPowerUsage", handle).power_mw

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        return self._device("nvmlDeviceGetTemperature", handle).temp_c

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> SimpleNamespace:
        gpu = self._device("nvmlDeviceGetUtilizationRates", handle)
        return SimpleNamespace(gpu=gpu.util[0], memory=gpu.util[1])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrentClocksEventReasons", handle).reasons

    def nvmlDeviceGetPerformanceState(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetPerformanceState", handle).pstate

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        return self._device("nvmlDeviceGetTotalEccErrors", handle).ecc[(error_type, counter_type)]

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        return self._device("nvmlDeviceGetRemappedRows", handle).remapped

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[SimpleNamespace]:
        gpu = self._device("nvmlDeviceGetComputeRunningProcesses", handle)
        return [SimpleNamespace(pid=pid, usedGpuMemory=1 << 30) for pid in gpu.pids]

    def _nvmlGetFunctionPointer(self, name: str) -> Any:
        """pynvml's table of C functions: each answers as the C function would (a return code, the output
        written through the pointer passed last), counted under its wrapper's name."""
        if name == "nvmlDeviceGetComputeRunningProcesses_v3":
            return self._process_count
        if not self.c_table or not name.startswith("nvmlDevice") or not hasattr(self, name):
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        if name == "nvmlDeviceGetFieldValues":
            return self._c_field_values
        return functools.partial(self._c_call, getattr(self, name))

    @staticmethod
    def _c_call(wrapper: Any, handle: FakeHandle, *args: Any) -> int:
        *inputs, out = args
        try:
            result = wrapper(handle, *inputs)
        except NVMLError as exc:
            return exc.value
        target = out._obj  # ctypes.byref(...) of the caller's buffer
        if isinstance(target, ctypes.Structure):
            for name, _ in target._fields_:
                setattr(target, name, getattr(result, name))
        else:
            target.value = result
        return NVML_SUCCESS

    def _c_field_values(self, handle: FakeHandle, count: int, values: Any) -> int:
        array = values._obj
        try:
            results = self.nvmlDeviceGetFieldValues(handle, [array[i].fieldId for i in range(count)])
        except NVMLError as exc:
            return exc.value
        for slot, result in zip(array, results, strict=True):
            slot.nvmlReturn, slot.valueType = result.nvmlReturn, result.valueType
            if result.nvmlReturn == NVML_SUCCESS:
                member = _VALUE_MEMBERS[result.valueType]
                setattr(slot.value, member, getattr(result.value, member))
        return NVML_SUCCESS

    def _process_count(self, handle: FakeHandle, count: Any, infos: None) -> int:
        """The C call with no buffer: SUCCESS when no process runs, else INSUFFICIENT_SIZE and the count."""
        gpu = self._device(PROCESS_COUNT, handle)
        assert infos is None, "the count is asked with no buffer"
        count._obj.value = len(gpu.pids)  # ctypes.byref(...) of the caller's c_uint
        return NVML_ERROR_INSUFFICIENT_SIZE if gpu.pids else NVML_SUCCESS

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: list[int]) -> list[SimpleNamespace]:
        gpu = self._device("nvmlDeviceGetFieldValues", handle)
        members = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
        results = []
        for field_id in field_ids:
            if f"field:{field_id}" in gpu.unsupported or field_id not in gpu.fields:
                results.append(SimpleNamespace(fieldId=field_id, nvmlReturn=NVML_ERROR_NOT_SUPPORTED, valueType=0))
                continue
            value_type, value = gpu.fields[field_id]
            union = SimpleNamespace(**{members[value_type]: value})
            results.append(
                SimpleNamespace(fieldId=field_id, nvmlReturn=NVML_SUCCESS, valueType=value_type, value=union)
            )
        return results

    # slow

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetPcieReplayCounter", handle).pcie_replay

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrPcieLinkGeneration", handle).pcie_link[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetCurrPcieLinkWidth", handle).pcie_link[1]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetMaxPcieLinkGeneration", handle).pcie_link_max[0]

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetMaxPcieLinkWidth", handle).pcie_link_max[1]

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        gpu = self._device("nvmlDeviceGetNvLinkState", handle)
        if not gpu.nvlink_states:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        if link >= len(gpu.nvlink_states):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return gpu.nvlink_states[link]

    def nvmlDeviceGetGpuFabricInfo(self, handle: FakeHandle, info: Any) -> int:
        gpu = self._device("nvmlDeviceGetGpuFabricInfo", handle)
        target = info._obj  # ctypes.byref(...) of the caller's structure
        target.state, target.status = gpu.fabric or (NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, 0)
        return NVML_SUCCESS

    def nvmlDeviceGetViolationStatus(self, handle: FakeHandle, policy: int) -> SimpleNamespace:
        gpu = self._device("nvmlDeviceGetViolationStatus", handle)
        return SimpleNamespace(referenceTime=0, violationTime=gpu.violations_ns[policy])

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetTotalEnergyConsumption", handle).energy_mj

    # events

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        return self._device("nvmlDeviceGetSupportedEventTypes", handle).supported_events

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self.calls["nvmlEventSetCreate"] += 1
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        gpu = self._device("nvmlDeviceRegisterEvents", handle)
        if event_types & ~gpu.supported_events:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        event_set.masks[handle.index] = event_types

    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeout_ms: int) -> SimpleNamespace:
        """Deliver the oldest queued event this set is registered for; TIMEOUT at once if none."""
        self.calls["nvmlEventSetWait_v2"] += 1
        self.waits.append(timeout_ms)
        if self.wait_error is not None:
            raise NVMLError(self.wait_error)
        for queued in list(self._events):
            index, event_type, data = queued
            if event_set.masks.get(index, 0) & event_type:
                self._events.remove(queued)
                return SimpleNamespace(
                    device=FakeHandle(index),
                    eventType=event_type,
                    eventData=data,
                    gpuInstanceId=0xFFFFFFFF,
                    computeInstanceId=0xFFFFFFFF,
                )
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        self.calls["nvmlEventSetFree"] += 1
        event_set.freed = True
