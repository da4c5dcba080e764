"""How often the NVML backend makes each per-sample read: the read plan, and the cheap process count.

Every NVML call a sample makes is also time the training job beside the daemon may lose (docs/
performance-interference.md measures it per call). A reading whose rule judges it over a long window,
or that can only change after a fault already seen at once, is read less often than every sample and
repeated in between; every slow sample reads them all. The periods come from the rules, not from cost
figures:

* PCIe generation and width: `pcie_link_degraded` holds only after `link_duty` (0.5) of `link_window_s`
  (60 s) busy, so a reading at most 5 s old moves that verdict by at most 5 s.
* ECC aggregate (lifetime) totals: the ECC rules count the larger growth of the volatile and the aggregate
  counter over `ecc_window_s` (an hour); the volatile ones are still read every sample and double-bit
  errors also arrive as events, so an aggregate at most 60 s old changes no verdict's time.
* The driver's recovery action (NVML field 230): the driver logs XID 154 ("GPU recovery action
  changed") when it sets one, and that XID is judged at once through the kernel log or NVML's event
  set (an unhealthy finding, reset suggested); the field itself, which names the action, lags by at
  most 5 s. It is the dearest per-sample read after the memory info: 10 µs of NVML on the H200.
* Row remapping: a remap is pending only after an uncorrectable error, which the ECC counters and events
  report at once; the flags themselves may show up to 30 s later (the default sampling interval).
* The process list: only the ranks' mapping, GPU tests and `gpuwatch_gpu_processes` use it, none of them
  a rule. The count (one call, 9 µs of NVML on the H200) is read when the memory in use moved since the
  last count (a process that starts or ends moves it: its CUDA context lives there), and the list (two
  calls while any process runs) when the count changed, on slow samples and at least every
  PIDS_LIST_EVERY_S.

BEFORE is the plan of the releases before it existed, kept so that `gpuwatch bench --only interference`
can measure a daemon with each plan in one run.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PIDS_LIST_EVERY_S = 30.0  # a process that replaced another between two samples is listed at most this late


@dataclass(frozen=True)
class ReadPlan:
    """Seconds between reads of each tiered group (0: every sample); `pids_by_count` reads the count first, and
    only when the memory in use moved."""

    pcie_width_s: float = 5.0
    pcie_gen_s: float = 5.0
    recovery_s: float = 5.0
    ecc_aggregate_s: float = 60.0
    remapped_s: float = 30.0
    pids_by_count: bool = True
    pids_list_s: float = PIDS_LIST_EVERY_S


DEFAULT = ReadPlan()
BEFORE = ReadPlan(pcie_gen_s=0.0, recovery_s=0.0, ecc_aggregate_s=0.0, remapped_s=0.0, pids_by_count=False)


def due(last_t: float, now: float, period_s: float, slow: bool) -> bool:
    """Whether a group last read at `last_t` is read again at `now` (always on slow samples and when time went back)."""
    return slow or not last_t <= now < last_t + period_s


def process_count(nvml: Any, handle: Any) -> int:
    """How many compute processes NVML lists on the GPU, in one call (the list itself makes two while any runs).

    ref. nvml.h nvmlDeviceGetComputeRunningProcesses_v3: with *infoCount 0 and no buffer it answers
    NVML_SUCCESS when there is none, else NVML_ERROR_INSUFFICIENT_SIZE with the count in *infoCount.
    pynvml wraps only the list, so this calls the C function through pynvml's function table.

    Raises:
        nvml.NVMLError: as the list would (FUNCTION_NOT_FOUND where the binding or the driver lacks it).
    """
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        raise nvml.NVMLError(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
    count = ctypes.c_uint(0)
    return _count(nvml, lookup("nvmlDeviceGetComputeRunningProcesses_v3")(handle, ctypes.byref(count), None), count)


def bind_process_count(nvml: Any, handle: Any) -> Callable[[], int]:
    """process_count of one GPU with the C function and its buffer found once (the sampler calls it every sample);
    process_count itself where the binding's table lacks the function, raising as it does."""
    try:
        lookup = nvml._nvmlGetFunctionPointer
        fn = lookup("nvmlDeviceGetComputeRunningProcesses_v3")
    except (AttributeError, nvml.NVMLError):
        return functools.partial(process_count, nvml, handle)
    count = ctypes.c_uint(0)
    pointer = ctypes.byref(count)

    def read() -> int:
        count.value = 0  # no buffer: NVML answers with the count
        return _count(nvml, fn(handle, pointer, None), count)

    return read


def _count(nvml: Any, code: int, count: ctypes.c_uint) -> int:
    if code == nvml.NVML_SUCCESS:
        return 0
    if code == nvml.NVML_ERROR_INSUFFICIENT_SIZE:
        return int(count.value)
    raise nvml.NVMLError(code)
