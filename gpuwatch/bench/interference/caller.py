"""The attribution's helper: one kind of NVML call at a time, in a loop at a fixed rate, in a process of its own.

The daemon makes each of its calls about once a second per GPU; a cost that small hides in the job's
noise, so the helper makes one kind of call many times a second (the rate is a parameter) and the
job's slowdown beside it, divided by the calls made, is what one call costs the job. Scaled back to
the daemon's own rate of that call (under the read plan before and after, nvml_plan.py) it says how
much of the daemon's cost that call is. Kinds marked unscaled are measured at their own pace: holding
an event set, and the event thread's real 500 ms wait.

Every kind is one call of what NvmlBackend.sample, its slow sample and its event thread make, plus
the alternatives worth knowing (the process list's other variants, field-value batches instead of
single calls). The sample kinds call NvmlBackend.sample itself, with a clock that moves one second a
call, so its tiers and slow samples come at the daemon's 1 s ratio.

Protocol (stdin → stdout, a line each): `probe KIND` → `ok` | `failed <why>`; `run KIND RATE` → `running`
after the first call | `failed <why>`; `stop` → `stopped <calls> <seconds> <errors>`; `quit`.
"""

from __future__ import annotations

import argparse
import functools
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatch.backends import nvml_plan
from gpuwatch.backends.nvml_plan import ReadPlan
from gpuwatch.bench.interference.child import Child, answer
from gpuwatch.config import Config, NvmlConfig, SimConfig

Call = Callable[[], object]
SLOW_EVERY_S = Config().slow_interval_s
FIELD_SETS = {
    "fields_sample": ("NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_POWER_INSTANT", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
    "fields_links": (
        "NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS",
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    ),
    "field_one": ("NVML_FI_DEV_MEMORY_TEMP",),
    "fields_ecc": (
        "NVML_FI_DEV_ECC_SBE_VOL_TOTAL",
        "NVML_FI_DEV_ECC_DBE_VOL_TOTAL",
        "NVML_FI_DEV_ECC_SBE_AGG_TOTAL",
        "NVML_FI_DEV_ECC_DBE_AGG_TOTAL",
    ),
    "fields_remap": (
        "NVML_FI_DEV_REMAPPED_COR",
        "NVML_FI_DEV_REMAPPED_UNC",
        "NVML_FI_DEV_REMAPPED_PENDING",
        "NVML_FI_DEV_REMAPPED_FAILURE",
    ),
}
FIELD_SETS["fields_11"] = FIELD_SETS["fields_sample"] + FIELD_SETS["fields_ecc"] + FIELD_SETS["fields_remap"]
# kind → the pynvml function it calls and the names of the pynvml constants it passes after the handle
DIRECT: dict[str, tuple[str, tuple[str, ...]]] = {
    "clock_sm": ("nvmlDeviceGetClockInfo", ("NVML_CLOCK_SM",)),
    "clock_mem": ("nvmlDeviceGetClockInfo", ("NVML_CLOCK_MEM",)),
    "power": ("nvmlDeviceGetPowerUsage", ()),
    "temp": ("nvmlDeviceGetTemperature", ("NVML_TEMPERATURE_GPU",)),
    "utilization": ("nvmlDeviceGetUtilizationRates", ()),
    "memory_info": ("nvmlDeviceGetMemoryInfo", ()),
    "reasons": ("nvmlDeviceGetCurrentClocksEventReasons", ()),
    "pstate": ("nvmlDeviceGetPerformanceState", ()),
    "ecc_volatile": ("nvmlDeviceGetTotalEccErrors", ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC")),
    "ecc_aggregate": ("nvmlDeviceGetTotalEccErrors", ("NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC")),
    "remapped_rows": ("nvmlDeviceGetRemappedRows", ()),
    "procs_list": ("nvmlDeviceGetComputeRunningProcesses", ()),
    "procs_graphics": ("nvmlDeviceGetGraphicsRunningProcesses", ()),
    "procs_mps": ("nvmlDeviceGetMPSComputeRunningProcesses", ()),
    "procs_detail": (
        "nvmlDeviceGetRunningProcessDetailList",
        ("nvmlProcessDetailList_v1", "NVML_PROCESS_MODE_COMPUTE"),
    ),
    "pcie_gen": ("nvmlDeviceGetCurrPcieLinkGeneration", ()),
    "pcie_width": ("nvmlDeviceGetCurrPcieLinkWidth", ()),
    "pcie_replay": ("nvmlDeviceGetPcieReplayCounter", ()),
    "violation": ("nvmlDeviceGetViolationStatus", ("NVML_PERF_POLICY_POWER",)),
    "energy": ("nvmlDeviceGetTotalEnergyConsumption", ()),
}


def every(period_s: float) -> float:
    """Calls a second of a group read every `period_s` at a 1 s interval (0: every sample)."""
    return 1.0 if period_s <= 0 else 1.0 / max(period_s, 1.0)


@dataclass(frozen=True)
class Kind:
    """One kind of call: what it is, and how often the daemon makes it per GPU at 1 s under a read plan.

    `per_s` None: measured at its own pace, not scaled (holding an event set, the real 500 ms wait).
    """

    name: str
    what: str
    per_s: Callable[[ReadPlan], float] | None = None


def _rate(value: float) -> Callable[[ReadPlan], float]:
    return lambda plan: value


NVML_KINDS = (
    Kind("clock_sm", "nvmlDeviceGetClockInfo(SM)", _rate(1)),
    Kind("clock_mem", "nvmlDeviceGetClockInfo(MEM)", _rate(1)),
    Kind("power", "nvmlDeviceGetPowerUsage", _rate(1)),
    Kind("temp", "nvmlDeviceGetTemperature(GPU)", _rate(1)),
    Kind("utilization", "nvmlDeviceGetUtilizationRates", _rate(1)),
    Kind("memory_info", "nvmlDeviceGetMemoryInfo", _rate(1)),
    Kind("reasons", "nvmlDeviceGetCurrentClocksEventReasons", _rate(1)),
    Kind("pstate", "nvmlDeviceGetPerformanceState", _rate(1)),
    Kind("ecc_volatile", "nvmlDeviceGetTotalEccErrors(volatile), one of two a sample", _rate(2)),
    Kind("ecc_aggregate", "nvmlDeviceGetTotalEccErrors(aggregate), one of two", lambda p: 2 * every(p.ecc_aggregate_s)),
    Kind("fields_ecc", "nvmlDeviceGetFieldValues, the 4 ECC totals in one call (alternative)", _rate(0)),
    Kind("remapped_rows", "nvmlDeviceGetRemappedRows", lambda p: every(p.remapped_s)),
    Kind("fields_remap", "nvmlDeviceGetFieldValues, the 4 row-remap fields (alternative)", _rate(0)),
    Kind(
        "procs_list",
        "nvmlDeviceGetComputeRunningProcesses (v3: count, then list)",
        lambda p: every(p.pids_list_s) if p.pids_by_count else 1.0,
    ),
    Kind("procs_count", "the v3 process count alone (one C call)", lambda p: 1.0 if p.pids_by_count else 0.0),
    Kind("procs_graphics", "nvmlDeviceGetGraphicsRunningProcesses (alternative)", _rate(0)),
    Kind("procs_mps", "nvmlDeviceGetMPSComputeRunningProcesses (alternative)", _rate(0)),
    Kind("procs_detail", "nvmlDeviceGetRunningProcessDetailList(compute) (alternative)", _rate(0)),
    Kind("fields_sample", "nvmlDeviceGetFieldValues, the sample's 3 fields", _rate(1)),
    Kind("field_one", "nvmlDeviceGetFieldValues, 1 field (alternative)", _rate(0)),
    Kind("fields_11", "nvmlDeviceGetFieldValues, 11 fields: the 3 + ECC + remap (alternative)", _rate(0)),
    Kind("fields_links", "nvmlDeviceGetFieldValues, the slow sample's 3 link fields", _rate(1 / SLOW_EVERY_S)),
    Kind("pcie_gen", "nvmlDeviceGetCurrPcieLinkGeneration", lambda p: every(p.pcie_gen_s)),
    Kind("pcie_width", "nvmlDeviceGetCurrPcieLinkWidth", lambda p: every(p.pcie_width_s)),
    Kind("pcie_replay", "nvmlDeviceGetPcieReplayCounter (slow sample)", _rate(1 / SLOW_EVERY_S)),
    Kind("violation", "nvmlDeviceGetViolationStatus(power), one of two (slow sample)", _rate(2 / SLOW_EVERY_S)),
    Kind("energy", "nvmlDeviceGetTotalEnergyConsumption (slow sample)", _rate(1 / SLOW_EVERY_S)),
    Kind("event_set_idle", "an event set registered (XID, double- and single-bit ECC), no wait: its presence"),
    Kind("event_set_xid", "an event set registered for XIDs only, no wait: its presence"),
    Kind("event_wait_500ms", "the event thread: nvmlEventSetWait_v2, 500 ms timeout, back to back"),
    Kind("event_wait_5ms", "nvmlEventSetWait_v2, 5 ms timeout (a daemon with a set waits twice a second)", _rate(2)),
    Kind("sample_before", "NvmlBackend.sample, read plan before (1 virtual second a call)", _rate(1)),
    Kind("sample_after", "NvmlBackend.sample, read plan now (1 virtual second a call)", _rate(1)),
)
SIM_KINDS = (Kind("sample_sim", "SimBackend.sample (no NVML: the CPU side of a sample only)", _rate(1)),)
# The event kinds: (nvml.events of the backend that holds the set, the wait's timeout; None: no wait).
EVENT_KINDS: dict[str, tuple[str, float | None]] = {
    "event_set_idle": ("all", None),
    "event_set_xid": ("xid", None),
    "event_wait_500ms": ("all", 0.5),
    "event_wait_5ms": ("all", 0.005),
}


@dataclass
class Calls:
    """What the helper process holds open for the kinds: pynvml and a handle, or the sim backend."""

    backend: str
    gpu: int
    sim_gpus: int
    opened: dict[str, Any] = field(default_factory=dict)
    segment: Any = None  # what only the current kind holds (an event set's backend): closed by end()

    def end(self) -> None:
        """After a probe or a run: free what only that kind held, so no event set outlives its segment."""
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    def make(self, kind: str) -> Call | None:
        """One call of `kind` (None: the kind makes no call, only holds something open)."""
        if self.backend == "sim":
            return self._sample(kind)
        nv, h = self._nvml()
        if kind == "procs_count":
            return functools.partial(nvml_plan.process_count, nv, h)
        if kind in DIRECT:
            # AttributeError: a binding without that function or constant; the kind is then left out
            function, constants = DIRECT[kind]
            return functools.partial(getattr(nv, function), h, *(getattr(nv, name) for name in constants))
        if kind in FIELD_SETS:
            ids = [getattr(nv, name) for name in FIELD_SETS[kind]]  # AttributeError: a binding without them
            return functools.partial(_field_values, nv, h, ids)
        return self._backend_call(nv, kind)

    def _nvml(self) -> tuple[Any, Any]:
        if "pynvml" not in self.opened:
            import pynvml

            pynvml.nvmlInit()
            self.opened["pynvml"] = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(self.gpu))
        nvml_and_handle: tuple[Any, Any] = self.opened["pynvml"]
        return nvml_and_handle

    def _backend_call(self, nvml: Any, kind: str) -> Call | None:
        """The kinds that go through NvmlBackend itself: its sample, and its event thread's set and wait.

        The sample kinds keep their backend open; an event kind gets one of its own for its segment only
        (an event set registered during the alone segments would be in the baseline), with the event
        types that kind names (EVENT_KINDS; a backend not told of a kernel log registers them all).
        """
        from gpuwatch.backends.nvml import NvmlBackend

        if kind in ("sample_before", "sample_after"):
            plan = nvml_plan.BEFORE if kind == "sample_before" else nvml_plan.DEFAULT
            if kind not in self.opened:
                self.opened[kind] = NvmlBackend(Config(backend="nvml"), nvml, plan=plan)
                self.opened[kind].open()
            return _VirtualSamples(self.opened[kind], self.gpu).next
        events, timeout = EVENT_KINDS[kind]  # KeyError: no such kind
        self.end()
        self.segment = NvmlBackend(Config(backend="nvml", nvml=NvmlConfig(events=events)), nvml)
        self.segment.open()
        self.segment.wait_events(0)  # creates and registers the set, as the event thread's first wait does
        return None if timeout is None else functools.partial(self.segment.wait_events, timeout)

    def _sample(self, kind: str) -> Call:
        from gpuwatch.backends.sim import SimBackend

        if kind != "sample_sim":
            raise KeyError(kind)
        if "sim" not in self.opened:
            backend = SimBackend(Config(backend="sim", sim=SimConfig(gpus=self.sim_gpus, scenario="healthy")))
            backend.open()
            self.opened["sim"] = backend
        return _VirtualSamples(self.opened["sim"], 0).next


class _VirtualSamples:
    """backend.sample on a clock that moves 1 s a call, with a slow sample every slow_interval_s, as Monitor.tick."""

    def __init__(self, backend: Any, index: int) -> None:
        self.backend, self.index = backend, index
        self.t = time.time()
        self.last_slow = float("-inf")

    def next(self) -> object:
        self.t += 1.0
        slow = self.t - self.last_slow >= SLOW_EVERY_S
        if slow:
            self.last_slow = self.t
        return self.backend.sample(self.index, self.t, slow=slow)


def _field_values(nvml: Any, handle: Any, ids: list[int]) -> object:
    return nvml.nvmlDeviceGetFieldValues(handle, ids)


def _serve(calls: Calls) -> None:
    """Answer the parent's commands until `quit` or the end of stdin."""
    commands: queue.SimpleQueue[list[str]] = queue.SimpleQueue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(line.split())
        commands.put(["quit"])

    threading.Thread(target=read, name="commands", daemon=True).start()
    while True:
        command = commands.get()
        if command[0] == "quit":
            return
        if command[0] not in ("probe", "run"):
            continue  # a `stop` with nothing running
        try:
            call = calls.make(command[1])
            if call is not None:
                call()
        except Exception as exc:  # an unsupported call, a binding without it: that kind is left out
            calls.end()
            answer(f"failed {type(exc).__name__}: {exc}".replace("\n", " "))
            continue
        if command[0] == "probe":
            calls.end()
            answer("ok")
            continue
        answer("running")
        made, seconds, errors = _loop(call, float(command[2]), commands)
        calls.end()  # before the answer: the parent times alone next
        answer(f"stopped {made} {seconds!r} {errors}")


def _loop(call: Call | None, rate: float, commands: queue.SimpleQueue[list[str]]) -> tuple[int, float, int]:
    """`call` at `rate` a second (as fast as it returns when slower) until `stop`: calls, seconds, errors.

    With no call (a kind that only holds something open) it blocks until `stop`: it wakes no more
    often than in an alone segment, so the two differ by what it holds only.
    """
    period = 1.0 / rate
    calls = errors = 0
    perf = time.perf_counter
    started = due = perf()
    while call is not None and commands.empty():
        try:
            call()
        except Exception:  # an NVML error now and then must not end the measurement; it is counted
            errors += 1
        calls += 1
        due += period
        wait = due - perf()
        if wait > 0:
            time.sleep(wait)
        elif wait < -period:
            due = perf()  # behind: go on at the call's own pace, without a burst to catch up
    elapsed = perf() - started
    command = commands.get()
    if command[0] == "quit":
        commands.put(command)
    return calls, elapsed, errors


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("nvml", "sim"), required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--sim-gpus", type=int, default=1)
    args = parser.parse_args(argv)
    _serve(Calls(args.backend, args.gpu, args.sim_gpus))


class CallerProcess:
    """The parent's end of the helper.

    Raises (from run and stop): RuntimeError when the helper exited or gave no answer.
    """

    ANSWER_TIMEOUT_S = 30.0

    def __init__(self, backend: str, gpu: int, sim_gpus: int, stderr_path: Path) -> None:
        argv = [sys.executable, "-m", "gpuwatch.bench.interference.caller", "--backend", backend]
        argv += ["--gpu", str(gpu), "--sim-gpus", str(sim_gpus)]
        self._child = Child("NVML helper", argv, stderr_path)

    @property
    def pid(self) -> int:
        return self._child.pid

    def probe(self, kind: str) -> str:
        """ "" when the helper can make `kind`'s call here, else why not."""
        reply = self._child.ask(f"probe {kind}", self.ANSWER_TIMEOUT_S)
        return "" if reply == "ok" else reply.removeprefix("failed ")

    def run(self, kind: str, rate: float) -> None:
        reply = self._child.ask(f"run {kind} {rate!r}", self.ANSWER_TIMEOUT_S)
        if reply != "running":
            raise RuntimeError(f"the helper could not run {kind}: {reply}")

    def stop(self) -> tuple[int, float, int]:
        """Calls made, seconds, and errors since run()."""
        reply = self._child.ask("stop", self.ANSWER_TIMEOUT_S).split()
        if reply[0] != "stopped":
            raise RuntimeError(f"the helper answered {' '.join(reply)!r} to stop")
        return int(reply[1]), float(reply[2]), int(reply[3])

    def close(self) -> None:
        self._child.close()


if __name__ == "__main__":
    main()
