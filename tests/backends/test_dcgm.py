"""DcgmBackend against a fake of DCGM's bindings: mapping, units, sentinels, XIDs, error kinds, loading."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.backends.base import Backend
from gpuwatch.backends.dcgm import SAMPLE_FIELDS, DcgmBackend
from gpuwatch.config import Config, ToolsConfig
from gpuwatch.errors import BackendUnavailable, GpuReadError
from gpuwatch.model import SAMPLE_FIELDS as TRACE_FIELDS
from gpuwatch.model import GpuError, GpuEvent, GpuStatic
from tests.fakes import fake_dcgm as fake
from tests.fakes.fake_dcgm import FakeDcgm


@pytest.fixture
def dcgm() -> FakeDcgm:
    return FakeDcgm()


@pytest.fixture
def backend(dcgm: FakeDcgm) -> Any:
    backend = DcgmBackend(Config(interval_s=10.0), dcgm=dcgm.bindings())
    backend.open()
    yield backend
    backend.close()


def test_is_a_backend() -> None:
    assert isinstance(DcgmBackend(Config()), Backend)


def test_every_trace_field_but_pids_has_a_dcgm_field() -> None:
    # NVLink and fabric states have no DCGM field (the NVML backend reads them).
    unmapped = {"t", "index", "uuid", "pids", "nvlink_links_down", "fabric_state", "fabric_status"}
    assert set(TRACE_FIELDS) - set(SAMPLE_FIELDS) == unmapped


def test_open_maps_statics(dcgm: FakeDcgm) -> None:
    backend = DcgmBackend(Config(), dcgm=dcgm.bindings())
    statics = backend.open()
    assert statics[1] == GpuStatic(
        index=1,
        uuid="GPU-5fa0c5b1",
        name="NVIDIA H200",
        pci_bus_id="00000000:00:07.0",
        max_sm_clock_mhz=1980,
        max_mem_clock_mhz=3201,
        power_limit_w=700.0,
        memory_total_bytes=143771 * 1024 * 1024,
        slowdown_temp_c=89,
        shutdown_temp_c=95,
        mem_max_temp_c=95,
        gpu_max_temp_c=87,
    )
    backend.close()


def test_index_is_the_nvml_index() -> None:
    dcgm = FakeDcgm({5: fake.FakeDcgmGpu(fake.h200_fields(nvml_index=2))})
    backend = DcgmBackend(Config(), dcgm=dcgm.bindings())
    assert [s.index for s in backend.open()] == [2]
    assert backend.sample(2, 1.0).temp_c == 61


def test_watch_uses_the_interval(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    assert dcgm.watch_args[0] == 10_000_000
    assert {100, 101, 112, 140, 150, 155, 202, 230, 310, 311, 312, 313, 393, 394, 395, 396} <= dcgm.watched
    assert dcgm.calls["dcgmUpdateAllFields"] == 1


def test_sample_maps_units(backend: DcgmBackend) -> None:
    sample = backend.sample(0, 1796037709.5)
    assert sample.t == 1796037709.5 and sample.uuid == "GPU-cc1b419f-1257-3993-729d-08492b313adb"
    assert (sample.sm_clock_mhz, sample.mem_clock_mhz, sample.clocks_event_reasons) == (1425, 3201, 4)
    assert sample.power_w == pytest.approx(690.123) and sample.power_instant_mw == 689500
    assert (sample.temp_c, sample.mem_temp_c) == (61, 66)
    assert (sample.util_gpu_pct, sample.util_mem_pct, sample.pstate) == (100, 45, 0)
    assert sample.memory_used_bytes == 615 * 1024 * 1024
    assert (sample.energy_mj, sample.pcie_replay) == (47746405, 7)
    assert (sample.violation_power_ns, sample.violation_thermal_ns) == (61100084832, 12)
    ecc = (sample.ecc_sbe_volatile, sample.ecc_dbe_volatile, sample.ecc_sbe_aggregate, sample.ecc_dbe_aggregate)
    assert ecc == (1, 2, 3, 4)
    remap = (sample.remapped_cor, sample.remapped_unc, sample.remapped_pending, sample.remapped_failure)
    assert remap == (5, 6, 0, 1)
    assert sample.pids == ()
    assert dataclasses.replace(sample, t=2.0) == dataclasses.replace(backend.sample(0, 2.0, slow=True), t=2.0)


@pytest.mark.parametrize(
    ("field_id", "raw", "attr"),
    [
        (140, fake.DCGM_INT64_NOT_SUPPORTED, "mem_temp_c"),
        (140, fake.DCGM_INT32_NOT_SUPPORTED, "mem_temp_c"),
        (155, fake.DCGM_FP64_BLANK, "power_w"),
        (157, fake.DCGM_FP64_BLANK + 2.0, "power_instant_mw"),
        (393, fake.DCGM_INT64_BLANK, "remapped_unc"),
        (190, 32, "pstate"),
    ],
)
def test_sentinels_are_none(dcgm: FakeDcgm, field_id: int, raw: Any, attr: str) -> None:
    dcgm.gpus[0].values[field_id] = raw
    backend = DcgmBackend(Config(), dcgm=dcgm.bindings())
    backend.open()
    sample = backend.sample(0, 1.0)
    assert getattr(sample, attr) is None
    assert sample.sm_clock_mhz == 1425


def test_blank_static_string_is_default(dcgm: FakeDcgm) -> None:
    dcgm.gpus[0].values[50] = fake.DCGM_STR_NOT_SUPPORTED
    dcgm.gpus[0].values[151] = fake.DCGM_INT64_NOT_SUPPORTED
    static = DcgmBackend(Config(), dcgm=dcgm.bindings()).open()[0]
    assert static.name == "" and static.mem_max_temp_c is None and static.gpu_max_temp_c == 87


def test_field_status_not_supported_is_none(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    dcgm.gpus[0].status[202] = fake.DCGM_ST_NOT_SUPPORTED
    assert backend.sample(0, 1.0).pcie_replay is None


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (fake.DCGM_ST_GPU_IS_LOST, "gpu_lost"),
        (fake.DCGM_ST_RESET_REQUIRED, "reset_required"),
        (fake.DCGM_ST_CONNECTION_NOT_VALID, "unknown"),
    ],
)
def test_read_errors_map_per_gpu(dcgm: FakeDcgm, backend: DcgmBackend, code: int, kind: str) -> None:
    dcgm.gpus[1].read_error = code
    with pytest.raises(GpuReadError) as err:
        backend.sample(1, 1.0)
    assert err.value.kind == kind and not isinstance(err.value, fake.DCGMError)
    assert backend.sample(0, 1.0).temp_c == 61


def test_lost_field_status_is_gpu_lost(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    dcgm.gpus[0].status[150] = fake.DCGM_ST_GPU_IS_LOST
    with pytest.raises(GpuReadError, match="gpu_lost"):
        backend.sample(0, 1.0)


def test_unknown_index(backend: DcgmBackend) -> None:
    with pytest.raises(GpuReadError, match="index 9"):
        backend.sample(9, 1.0)


def test_xid_change_is_an_event(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    assert backend.wait_events(0) == []
    dcgm.set_xid(1, 31, 1_796_037_800_250_000)
    events = backend.wait_events(0)
    assert events == [GpuEvent(t=1796037800.25, index=1, uuid="GPU-5fa0c5b1", kind="xid", xid=31)]
    assert backend.wait_events(0) == []
    dcgm.set_xid(1, 31, 1_796_037_801_000_000)
    assert [e.xid for e in backend.wait_events(0) if isinstance(e, GpuEvent)] == [31]


def test_xid_before_open_is_history() -> None:
    dcgm = FakeDcgm()
    dcgm.set_xid(0, 79, 1_796_037_000_000_000)
    backend = DcgmBackend(Config(), dcgm=dcgm.bindings())
    backend.open()
    assert backend.wait_events(0) == []


def test_xid_read_failure_reported_once(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    dcgm.gpus[0].read_error = fake.DCGM_ST_GPU_IS_LOST
    items = backend.wait_events(0)
    assert [(i.index, i.kind) for i in items if isinstance(i, GpuError)] == [(0, "gpu_lost")]
    assert backend.wait_events(0) == []


def test_wait_returns_after_timeout(backend: DcgmBackend) -> None:
    assert backend.wait_events(0.05) == []


def test_standalone_hostengine_preferred(dcgm: FakeDcgm) -> None:
    dcgm.hostengine_running = True
    backend = DcgmBackend(Config(), dcgm=dcgm.bindings())
    backend.open()
    assert dcgm.connected and not dcgm.embedded
    backend.close()
    assert not dcgm.connected


def test_embedded_when_no_hostengine(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    assert dcgm.embedded and dcgm.calls["dcgmConnect_v2"] == 1


def test_close_is_idempotent_and_cleans_up(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    backend.close()
    backend.close()
    assert not dcgm.embedded and not dcgm.live_groups and dcgm.init_count == 0
    assert dcgm.calls["dcgmShutdown"] == 1
    assert backend.wait_events(0) == []
    with pytest.raises(GpuReadError):
        backend.sample(0, 1.0)


def test_release_and_reacquire(dcgm: FakeDcgm, backend: DcgmBackend) -> None:
    backend.release_handles()
    assert not dcgm.embedded
    assert len(backend.reacquire()) == 2
    assert backend.sample(1, 1.0).temp_c == 61


def test_library_missing_is_unavailable(dcgm: FakeDcgm) -> None:
    dcgm.library_error = fake.DCGM_ST_LIBRARY_NOT_FOUND
    with pytest.raises(BackendUnavailable, match="DCGM"):
        DcgmBackend(Config(), dcgm=dcgm.bindings()).open()


def test_no_gpu_is_unavailable() -> None:
    dcgm = FakeDcgm({})
    with pytest.raises(BackendUnavailable, match="no supported GPU"):
        DcgmBackend(Config(), dcgm=dcgm.bindings()).open()
    assert not dcgm.embedded and dcgm.init_count == 0


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the binding modules importable only from where the test puts them."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("dcgm_agent", "dcgm_fields", "dcgm_structs"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_bindings_missing_is_unavailable(tmp_path: Path, clean_imports: None) -> None:
    config = Config(tools=ToolsConfig(dcgm_bindings=(str(tmp_path / "absent"),)))
    with pytest.raises(BackendUnavailable, match="bindings not importable") as err:
        DcgmBackend(config).open()
    assert str(tmp_path / "absent") in str(err.value)
    assert str(tmp_path / "absent") not in sys.path


def test_bindings_loaded_from_configured_folder(tmp_path: Path, clean_imports: None) -> None:
    """The folder goes on sys.path; here its libdcgm is missing, which is unavailable too."""
    (tmp_path / "dcgm_agent.py").write_text("")
    (tmp_path / "dcgm_fields.py").write_text("")
    (tmp_path / "dcgm_structs.py").write_text(
        "class DCGMError(Exception):\n"
        "    def __init__(self, value):\n"
        "        self.value = value\n"
        "def _dcgmInit():\n"
        "    raise DCGMError(-25)\n"
    )
    config = Config(tools=ToolsConfig(dcgm_bindings=(str(tmp_path),)))
    with pytest.raises(BackendUnavailable, match="DCGM is not usable"):
        DcgmBackend(config).open()
    assert str(tmp_path) in sys.path
