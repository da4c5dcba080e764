"""NvmlBackend against the module-shaped fake: units, unsupported fields, error mapping, events, call costs."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

from gpuwatch.backends import nvml_plan
from gpuwatch.backends.base import Backend
from gpuwatch.backends.nvml import NvmlBackend
from gpuwatch.config import Config, NvmlConfig
from gpuwatch.errors import BackendUnavailable, GpuReadError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic
from tests.fakes import fake_pynvml as fake
from tests.fakes.fake_pynvml import PROCESS_COUNT, FakeGpu, FakeNvml

SLOW_CALLS = (
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetViolationStatus",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetMaxClockInfo",
)


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def backend(nvml: FakeNvml) -> Any:
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    yield backend
    backend.close()


def test_fake_matches_installed_pynvml() -> None:
    """Every constant and function the fake offers exists in pynvml with the same value."""
    pynvml = pytest.importorskip("pynvml")
    for name, value in vars(fake).items():
        if name.startswith(("NVML_", "nvmlEventType")):
            assert getattr(pynvml, name) == value, name
    for name in dir(FakeNvml):
        if name.startswith("nvml"):
            assert callable(getattr(pynvml, name)), name
    # the process count calls the C function the list calls first, through pynvml's function table
    assert callable(pynvml._nvmlGetFunctionPointer)


def test_is_a_backend() -> None:
    assert isinstance(NvmlBackend(Config(), nvml=FakeNvml()), Backend)


def test_open_reads_statics_in_base_units(nvml: FakeNvml) -> None:
    backend = NvmlBackend(Config(), nvml=nvml)
    statics = backend.open()
    assert statics[0] == GpuStatic(
        index=0,
        uuid="GPU-cc1b419f-1257-3993-729d-08492b313adb",
        name="NVIDIA H200",
        pci_bus_id="00000000:00:06.0",
        max_sm_clock_mhz=1980,
        max_mem_clock_mhz=3201,
        power_limit_w=700.0,
        memory_total_bytes=150754820096,
        slowdown_temp_c=89,
        shutdown_temp_c=95,
        mem_max_temp_c=95,
        gpu_max_temp_c=87,
        pcie_link_gen_max=5,
        pcie_link_width_max=16,
    )
    assert [s.index for s in statics] == [0, 1]
    assert statics[1].pci_bus_id == "00000000:00:07.0"
    backend.close()


def test_static_fact_not_supported_is_none() -> None:
    gpu = FakeGpu(thresholds={fake.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: 89}, unsupported={"nvmlDeviceGetMaxClockInfo"})
    static = NvmlBackend(Config(), nvml=FakeNvml([gpu])).open()[0]
    assert static.slowdown_temp_c == 89
    assert static.shutdown_temp_c is None and static.gpu_max_temp_c is None
    assert static.max_sm_clock_mhz is None and static.max_mem_clock_mhz is None
    assert static.uuid.startswith("GPU-")


def test_sample_maps_every_fast_field(backend: NvmlBackend) -> None:
    sample = backend.sample(0, 1796037709.5)
    assert sample.t == 1796037709.5 and sample.index == 0 and sample.uuid.startswith("GPU-cc1b")
    assert (sample.sm_clock_mhz, sample.mem_clock_mhz) == (1425, 3201)
    assert sample.power_w == pytest.approx(690.123)
    assert (sample.temp_c, sample.mem_temp_c) == (61, 66)
    assert (sample.util_gpu_pct, sample.util_mem_pct) == (100, 45)
    assert sample.memory_used_bytes == 644939776
    assert sample.clocks_event_reasons == 0x4 and sample.pstate == 0
    ecc = (sample.ecc_sbe_volatile, sample.ecc_dbe_volatile, sample.ecc_sbe_aggregate, sample.ecc_dbe_aggregate)
    assert ecc == (1, 2, 3, 4)
    remap = (sample.remapped_cor, sample.remapped_unc, sample.remapped_pending, sample.remapped_failure)
    assert remap == (5, 6, 0, 1)
    assert sample.power_instant_mw == 689500
    assert sample.pids == (4242, 4243)


def slow_fields(sample: GpuSample) -> tuple[int | None, ...]:
    return sample.pcie_replay, sample.violation_power_ns, sample.violation_thermal_ns, sample.energy_mj


def test_slow_fields_are_read_when_asked_and_repeated_until_the_next_slow_sample(
    nvml: FakeNvml, backend: NvmlBackend
) -> None:
    """Every sample carries the slow counters, so every scrape has their series (a rate() needs each scrape)."""
    assert slow_fields(backend.sample(0, 1.0)) == (None,) * 4  # nothing read yet
    slow = backend.sample(0, 2.0, slow=True)
    assert slow_fields(slow) == (7, 61100084832, 12, 47746405)
    assert slow.sm_clock_mhz == 1425
    nvml.gpus[0].energy_mj += 1000
    assert [slow_fields(backend.sample(0, t)) for t in (3.0, 4.0)] == [slow_fields(slow)] * 2  # not read again
    assert backend.sample(0, 5.0, slow=True).energy_mj == 47746405 + 1000
    assert slow_fields(backend.sample(1, 5.0)) == (None,) * 4  # per GPU


def test_fast_path_makes_no_slow_call(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """DESIGN.md: energy 3.1 ms, violations 0.64 ms, PCIe 170 µs, max clocks 1.5 ms must stay off the fast path."""
    nvml.calls.clear()
    for t in range(5):
        backend.sample(0, float(t))
        backend.sample(1, float(t))
    assert not {name: nvml.calls[name] for name in SLOW_CALLS if nvml.calls[name]}
    # per sample: 8 single-field calls, 2 clocks, 2 volatile ECC totals and 1 field-values call; the read
    # plan's groups (PCIe link, recovery action, ECC aggregates, row remapping, process list) once per GPU
    # in these 5 s; no process count, as the memory in use did not move
    assert sum(nvml.calls.values()) == 10 * 11 + 2 * 7
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == 10 * 2 + 2 * 2
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 2 and nvml.calls[PROCESS_COUNT] == 0
    assert nvml.calls["nvmlDeviceGetFieldValues"] == 10 + 2
    nvml.calls.clear()
    backend.sample(0, 9.0, slow=True)
    assert [nvml.calls[name] for name in SLOW_CALLS] == [1, 2, 1, 0]
    tiered = ("nvmlDeviceGetRemappedRows", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth")
    assert [nvml.calls[name] for name in tiered] == [1, 1, 1]  # a slow sample reads every group
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 1 and nvml.calls[PROCESS_COUNT] == 0
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == 4


def test_plan_before_reads_every_group_every_sample(nvml: FakeNvml) -> None:
    """The plan of earlier releases (the bench measures a daemon with it): 16 calls a sample, the width every 5 s."""
    backend = NvmlBackend(Config(), nvml=nvml, plan=nvml_plan.BEFORE)
    backend.open()
    nvml.calls.clear()
    for t in range(5):
        backend.sample(0, float(t))
        backend.sample(1, float(t))
    assert sum(nvml.calls.values()) == 10 * 16 + 2
    assert nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 10 and nvml.calls[PROCESS_COUNT] == 0


def test_process_list_is_read_only_when_the_count_changes(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """No job changed: no call while the memory in use stands, one count call when it moves; a job appears
    or ends (its CUDA context moves the memory in use): the list is read at that sample."""
    lists, gpu = "nvmlDeviceGetComputeRunningProcesses", nvml.gpus[0]
    nvml.calls.clear()
    assert backend.sample(0, 100.0).pids == (4242, 4243)
    assert [backend.sample(0, t).pids for t in (101.0, 102.0)] == [(4242, 4243)] * 2
    assert (nvml.calls[lists], nvml.calls[PROCESS_COUNT]) == (1, 0)
    gpu.memory_used += 1 << 30  # a rank allocates: counted, the same two processes
    assert backend.sample(0, 103.0).pids == (4242, 4243)
    assert (nvml.calls[lists], nvml.calls[PROCESS_COUNT]) == (1, 1)
    gpu.pids, gpu.memory_used = (4242, 4243, 5150), gpu.memory_used + (500 << 20)  # a job starts on GPU 0
    assert backend.sample(0, 104.0).pids == (4242, 4243, 5150)
    assert (nvml.calls[lists], nvml.calls[PROCESS_COUNT]) == (2, 2)
    gpu.pids, gpu.memory_used = (), 0  # every process ends
    assert backend.sample(0, 105.0).pids == ()
    assert nvml.calls[lists] == 3
    gpu.pids, gpu.memory_used = (6000,), 500 << 20  # from none to one
    assert backend.sample(0, 106.0).pids == (6000,)
    assert (nvml.calls[lists], nvml.calls[PROCESS_COUNT]) == (4, 4)


def test_process_list_is_refreshed_when_due_and_on_slow_samples(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """A process that replaced another between two samples (same count) is listed within PIDS_LIST_EVERY_S."""
    backend.sample(0, 100.0)
    nvml.gpus[0].pids = (4242, 7777)
    assert backend.sample(0, 100.0 + nvml_plan.PIDS_LIST_EVERY_S - 1).pids == (4242, 4243)  # not due yet
    assert backend.sample(0, 100.0 + nvml_plan.PIDS_LIST_EVERY_S).pids == (4242, 7777)
    nvml.gpus[0].pids = (4242, 8888)
    assert backend.sample(0, 131.0, slow=True).pids == (4242, 8888)


def test_process_count_missing_falls_back_to_the_list(nvml: FakeNvml) -> None:
    """A driver without the count: it is asked once, then the list is read whenever the memory in use moves."""
    nvml.gpus[0].errors[PROCESS_COUNT] = fake.NVML_ERROR_FUNCTION_NOT_FOUND
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    for t in range(4):
        nvml.gpus[0].memory_used += 1 << 20
        assert backend.sample(0, float(t)).pids == (4242, 4243)
    assert nvml.calls[PROCESS_COUNT] == 1 and nvml.calls["nvmlDeviceGetComputeRunningProcesses"] == 4


def test_tiered_reads_repeat_the_last_value_until_due(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """ECC aggregates (60 s), row remapping (30 s) and the PCIe link (5 s) lag by at most their period;
    the volatile ECC totals, which the ECC rules read beside the aggregates, never lag."""
    gpu = nvml.gpus[0]
    backend.sample(0, 1000.0)
    sbe, dbe = fake.NVML_MEMORY_ERROR_TYPE_CORRECTED, fake.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    gpu.ecc[(dbe, fake.NVML_VOLATILE_ECC)] += 1
    gpu.ecc[(dbe, fake.NVML_AGGREGATE_ECC)] += 1
    gpu.ecc[(sbe, fake.NVML_AGGREGATE_ECC)] += 5
    gpu.remapped = (5, 7, 1, 1)
    gpu.pcie_link = (4, 8)
    s = backend.sample(0, 1001.0)
    assert (s.ecc_dbe_volatile, s.ecc_dbe_aggregate, s.ecc_sbe_aggregate) == (3, 4, 3)
    assert (s.remapped_pending, s.pcie_link_gen, s.pcie_link_width) == (0, 5, 16)
    s = backend.sample(0, 1005.0)
    assert (s.pcie_link_gen, s.pcie_link_width, s.remapped_pending) == (4, 8, 0)
    s = backend.sample(0, 1030.0)
    assert (s.remapped_pending, s.remapped_unc, s.ecc_dbe_aggregate) == (1, 7, 4)
    s = backend.sample(0, 1060.0)
    assert (s.ecc_dbe_aggregate, s.ecc_sbe_aggregate) == (5, 8)


def test_not_supported_is_none_and_not_retried() -> None:
    gpu = FakeGpu(
        unsupported={
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetTotalEccErrors",
            f"field:{fake.NVML_FI_DEV_MEMORY_TEMP}",
        }
    )
    nvml = FakeNvml([gpu])
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    first = backend.sample(0, 1.0)
    assert first.remapped_cor is None and first.remapped_failure is None
    assert first.ecc_dbe_volatile is None and first.ecc_sbe_aggregate is None
    assert first.mem_temp_c is None and first.power_instant_mw == 689500
    assert first.sm_clock_mhz == 1425
    calls = nvml.calls.copy()
    backend.sample(0, 2.0)
    assert nvml.calls["nvmlDeviceGetRemappedRows"] == calls["nvmlDeviceGetRemappedRows"]
    assert nvml.calls["nvmlDeviceGetTotalEccErrors"] == calls["nvmlDeviceGetTotalEccErrors"]
    assert nvml.calls["nvmlDeviceGetClockInfo"] == calls["nvmlDeviceGetClockInfo"] + 2


def test_function_missing_in_driver_is_unsupported() -> None:
    nvml = FakeNvml([FakeGpu(errors={"nvmlDeviceGetCurrentClocksEventReasons": fake.NVML_ERROR_FUNCTION_NOT_FOUND})])
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    assert backend.sample(0, 1.0).clocks_event_reasons is None


def test_unknown_pstate_is_none() -> None:
    backend = NvmlBackend(Config(), nvml=FakeNvml([FakeGpu(pstate=fake.NVML_PSTATE_UNKNOWN)]))
    backend.open()
    assert backend.sample(0, 1.0).pstate is None


def test_power_instant_skipped_when_binding_lacks_the_field() -> None:
    class OldNvml(FakeNvml):
        def __getattr__(self, name: str) -> Any:
            if name == "NVML_FI_DEV_POWER_INSTANT":
                raise AttributeError(name)
            return super().__getattr__(name)

    nvml = OldNvml()
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    sample = backend.sample(0, 1.0)
    assert sample.power_instant_mw is None and sample.mem_temp_c == 66


def test_lost_gpu_fails_alone(nvml: FakeNvml, backend: NvmlBackend) -> None:
    nvml.gpus[1].fail_all = fake.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuReadError) as err:
        backend.sample(1, 1.0)
    assert err.value.kind == "gpu_lost"
    assert backend.sample(0, 1.0).sm_clock_mhz == 1425


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (fake.NVML_ERROR_RESET_REQUIRED, "reset_required"),
        (fake.NVML_ERROR_UNKNOWN, "unknown"),
        (fake.NVML_ERROR_NO_PERMISSION, "unknown"),
    ],
)
def test_error_kinds(nvml: FakeNvml, backend: NvmlBackend, code: int, kind: str) -> None:
    nvml.gpus[0].errors["nvmlDeviceGetPowerUsage"] = code
    with pytest.raises(GpuReadError) as err:
        backend.sample(0, 1.0)
    assert err.value.kind == kind
    assert not isinstance(err.value, fake.NVMLError)
    if kind == "unknown":
        assert err.value.detail
    assert backend.sample(1, 1.0).power_w == pytest.approx(690.123)


def test_lost_field_value_fails_the_read(nvml: FakeNvml, backend: NvmlBackend) -> None:
    nvml.gpus[0].errors["nvmlDeviceGetFieldValues"] = fake.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(GpuReadError, match="gpu_lost"):
        backend.sample(0, 1.0)


def test_gpu_lost_at_open_keeps_its_index() -> None:
    nvml = FakeNvml()
    nvml.gpus[1].fail_all = fake.NVML_ERROR_GPU_IS_LOST
    backend = NvmlBackend(Config(), nvml=nvml)
    statics = backend.open()
    assert [s.index for s in statics] == [0, 1] and statics[1].uuid == ""
    with pytest.raises(GpuReadError) as err:
        backend.sample(1, 1.0)
    assert err.value.kind == "gpu_lost"
    assert backend.sample(0, 1.0).temp_c == 61


def test_unknown_index_and_closed_backend(backend: NvmlBackend) -> None:
    with pytest.raises(GpuReadError, match="index 7"):
        backend.sample(7, 1.0)
    backend.close()
    with pytest.raises(GpuReadError):
        backend.sample(0, 1.0)


@pytest.mark.parametrize("code", [fake.NVML_ERROR_LIBRARY_NOT_FOUND, fake.NVML_ERROR_DRIVER_NOT_LOADED])
def test_init_failure_is_unavailable(code: int) -> None:
    nvml = FakeNvml()
    nvml.init_error = code
    with pytest.raises(BackendUnavailable) as err:
        NvmlBackend(Config(), nvml=nvml).open()
    assert "\n" not in str(err.value) and str(err.value)


def test_no_gpu_is_unavailable() -> None:
    nvml = FakeNvml([])
    with pytest.raises(BackendUnavailable, match="no GPU"):
        NvmlBackend(Config(), nvml=nvml).open()
    assert nvml.initialized == 0


def test_missing_pynvml_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(BackendUnavailable, match="pynvml"):
        NvmlBackend(Config()).open()


def test_xid_and_dbe_events(nvml: FakeNvml) -> None:
    """With `nvml.events = all` (test_event_sources.py has the other modes)."""
    backend = NvmlBackend(Config(nvml=NvmlConfig(events="all")), nvml=nvml)
    backend.open()
    assert backend.wait_events(0.5) == []
    nvml.queue_event(1, fake.nvmlEventTypeXidCriticalError, 31)
    nvml.queue_event(0, fake.nvmlEventTypeDoubleBitEccError)
    events = backend.wait_events(0.5)
    assert [(e.index, e.kind, e.xid) for e in events if isinstance(e, GpuEvent)] == [
        (1, "xid", 31),
        (0, "ecc_dbe", None),
    ]
    assert events[0].uuid == nvml.gpus[1].uuid
    assert nvml.waits[:2] == [500, 500] and nvml.waits[2:] == [0, 0]


def test_events_register_only_supported_types(nvml: FakeNvml) -> None:
    nvml.gpus[1].supported_events = fake.nvmlEventTypeXidCriticalError | fake.nvmlEventTypePState
    backend = NvmlBackend(Config(nvml=NvmlConfig(events="all")), nvml=nvml)
    backend.open()
    backend.wait_events(0)
    assert nvml.event_sets[0].masks == {
        0: fake.nvmlEventTypeXidCriticalError | fake.nvmlEventTypeDoubleBitEccError,
        1: fake.nvmlEventTypeXidCriticalError,
    }


def test_timeout_is_empty(nvml: FakeNvml, backend: NvmlBackend) -> None:
    assert backend.wait_events(0.25) == []
    assert nvml.waits == [250]


def test_events_unsupported_logs_once_and_sleeps(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([FakeGpu(supported_events=0), FakeGpu(supported_events=fake.nvmlEventTypePState)])
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    with caplog.at_level(logging.WARNING, logger="gpuwatch.backends.nvml"):
        assert backend.wait_events(0.01) == []
        assert backend.wait_events(0.01) == []
    assert len([r for r in caplog.records if "events unavailable" in r.message]) == 1
    assert nvml.calls["nvmlEventSetWait_v2"] == 0 and nvml.event_sets[0].freed


def test_gpu_lost_during_wait(nvml: FakeNvml, backend: NvmlBackend) -> None:
    backend.wait_events(0)
    nvml.gpus[1].fail_all = fake.NVML_ERROR_GPU_IS_LOST
    nvml.wait_error = fake.NVML_ERROR_GPU_IS_LOST
    items = backend.wait_events(0)
    assert [(i.index, i.kind) for i in items if isinstance(i, GpuError)] == [(1, "gpu_lost")]
    assert nvml.event_sets[0].freed
    nvml.wait_error = None
    nvml.queue_event(0, fake.nvmlEventTypeXidCriticalError, 79)
    assert [(e.index, e.xid) for e in backend.wait_events(0) if isinstance(e, GpuEvent)] == [(0, 79)]
    assert nvml.event_sets[1].masks.keys() == {0}


def test_close_is_idempotent(nvml: FakeNvml, backend: NvmlBackend) -> None:
    backend.wait_events(0)
    backend.close()
    backend.close()
    assert nvml.initialized == 0 and nvml.event_sets[0].freed
    assert backend.wait_events(0) == []


def test_release_and_reacquire(nvml: FakeNvml, backend: NvmlBackend) -> None:
    backend.wait_events(0)
    backend.release_handles()
    assert nvml.initialized == 0 and nvml.event_sets[0].freed
    with pytest.raises(GpuReadError):
        backend.sample(0, 1.0)
    assert backend.wait_events(0) == []
    statics = backend.reacquire()
    assert nvml.initialized == 1 and len(statics) == 2
    assert backend.sample(0, 2.0).sm_clock_mhz == 1425
    nvml.queue_event(0, fake.nvmlEventTypeXidCriticalError, 13)
    assert [e.xid for e in backend.wait_events(0) if isinstance(e, GpuEvent)] == [13]


def test_recovery_action_is_read_every_5_s_and_on_slow_samples(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """The driver logs XID 154 when it sets a recovery action, judged at once; the field naming it lags by ≤ 5 s."""
    recovery, uint = fake.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, fake.NVML_VALUE_TYPE_UNSIGNED_INT
    nvml.gpus[0].pcie_link = (4, 8)
    s = backend.sample(0, 1.0)
    assert (s.recovery_action, s.pcie_link_gen, s.pcie_link_width) == (0, 4, 8)
    nvml.gpus[0].fields[recovery] = (uint, 2)
    assert backend.sample(0, 5.9).recovery_action == 0
    assert backend.sample(0, 6.0).recovery_action == 2
    nvml.gpus[0].fields[recovery] = (uint, 0)
    assert backend.sample(0, 7.0, slow=True).recovery_action == 0
    assert backend.sample(1, 1.0).recovery_action == 0


def test_recovery_action_a_gpu_lacks_is_none_and_not_read_again() -> None:
    gpu = FakeGpu(unsupported={f"field:{fake.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION}"})
    nvml = FakeNvml([gpu])
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    assert backend.sample(0, 1.0).recovery_action is None
    calls = nvml.calls["nvmlDeviceGetFieldValues"]
    assert backend.sample(0, 7.0, slow=True).recovery_action is None
    assert nvml.calls["nvmlDeviceGetFieldValues"] == calls + 2  # the sample's batch and the links', no recovery read


def test_links_read_on_slow_samples_and_repeated_on_fast_ones() -> None:
    nvlink = FakeGpu(nvlink_states=(1,) * 17 + (0,), fabric=(3, 0))
    nvlink.fields[fake.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL] = (fake.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 12)
    nvlink.fields[fake.NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS] = (fake.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 3)
    nvml = FakeNvml([nvlink])
    backend = NvmlBackend(Config(), nvml=nvml)
    backend.open()
    assert backend.sample(0, 1.0).nvlink_links_down is None  # nothing read yet
    slow = backend.sample(0, 2.0, slow=True)
    assert (slow.nvlink_links_down, slow.nvlink_crc_errors, slow.pcie_correctable_errors) == (1, 12, 3)
    assert (slow.fabric_state, slow.fabric_status) == (3, 0)
    states = nvml.calls["nvmlDeviceGetNvLinkState"]
    fast = backend.sample(0, 3.0)
    assert (fast.nvlink_links_down, fast.nvlink_crc_errors, fast.fabric_state) == (1, 12, 3)
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == states  # no link call on a fast sample


def test_pcie_only_card_reads_no_nvlink(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """The lab's H200: NVLink 'not supported' and no fabric read None, and NVLink is not asked again."""
    opened = nvml.calls["nvmlDeviceGetNvLinkState"]
    for t in range(3):
        s = backend.sample(0, float(t), slow=True)
        assert (s.nvlink_links_down, s.nvlink_crc_errors, s.nvlink_recovery_errors, s.fabric_state) == (None,) * 4
    assert nvml.calls["nvmlDeviceGetNvLinkState"] == opened


def test_pcie_width_is_read_every_5_s_and_on_slow_samples(nvml: FakeNvml, backend: NvmlBackend) -> None:
    """The costliest fast read: a reading at most PCIE_WIDTH_EVERY_S old is repeated in between."""
    nvml.calls.clear()
    widths = [backend.sample(0, t).pcie_link_width for t in (100.0, 101.0, 104.9, 105.0, 106.0)]
    assert nvml.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 2  # at 100 and at 105
    assert widths == [widths[0]] * 5 and widths[0] is not None
    backend.sample(0, 107.0, slow=True)
    backend.sample(0, 50.0)  # the clock went back (a test, a clock step): read again
    assert nvml.calls["nvmlDeviceGetCurrPcieLinkWidth"] == 4
