"""Where XIDs and ECC errors come from: the NVML event set as `nvml.events` asks, and the kernel log.

The backend against the module-shaped fake (which kinds each GPU registers, and none at all where the
kernel log covers every GPU), then a real Daemon on that fake with a kernel log file: an XID written
to the log is judged at once (long before the next sample) while no event set exists.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.backends.nvml import NvmlBackend, event_kinds
from gpuwatch.config import Config, NvmlConfig, load
from gpuwatch.errors import ConfigError
from gpuwatch.model import GpuEvent
from tests.fakes import fake_pynvml as fake
from tests.fakes.fake_pynvml import FakeGpu, FakeNvml, two_gpus

XID = fake.nvmlEventTypeXidCriticalError
DBE = fake.nvmlEventTypeDoubleBitEccError
SBE = fake.nvmlEventTypeSingleBitEccError


def _backend(mode: str, nvml: FakeNvml) -> NvmlBackend:
    backend = NvmlBackend(Config(nvml=NvmlConfig(events=mode)), nvml=nvml)
    backend.open()
    return backend


def _every_kind() -> FakeNvml:
    return FakeNvml([FakeGpu(supported_events=XID | DBE | SBE), FakeGpu(supported_events=XID | DBE | SBE)])


def test_the_modes_and_the_kernel_log_decide_the_kinds() -> None:
    assert event_kinds("auto", kernel_log=True) == ()
    assert event_kinds("auto", kernel_log=False) == ("xid",)
    assert event_kinds("xid", kernel_log=True) == ("xid",)
    assert event_kinds("all", kernel_log=True) == ("xid", "ecc_dbe", "ecc_sbe")
    assert event_kinds("none", kernel_log=False) == ()


@pytest.mark.parametrize(
    ("mode", "mask"),
    [("auto", XID), ("xid", XID), ("all", XID | DBE | SBE)],
)
def test_without_a_kernel_log_each_mode_registers_its_kinds(mode: str, mask: int) -> None:
    nvml = _every_kind()
    backend = _backend(mode, nvml)
    backend.wait_events(0)
    assert nvml.event_sets[0].masks == {0: mask, 1: mask}
    nvml.queue_event(1, XID, 48)  # a double-bit error, as the driver reports it: XID 48
    assert [(e.index, e.kind, e.xid) for e in backend.wait_events(0) if isinstance(e, GpuEvent)] == [(1, "xid", 48)]
    backend.close()


def test_auto_registers_no_event_set_where_the_kernel_log_covers_every_gpu(caplog: pytest.LogCaptureFixture) -> None:
    nvml = _every_kind()
    backend = _backend("auto", nvml)
    backend.kernel_log_covers({0, 1})
    nvml.queue_event(0, XID, 79)
    with caplog.at_level(logging.INFO, logger="gpuwatch.backends.nvml"):
        started = time.monotonic()
        assert backend.wait_events(0.05) == [] and backend.wait_events(0.05) == []
        assert time.monotonic() - started >= 0.09  # it paces the event thread instead of spinning
    assert nvml.calls["nvmlEventSetCreate"] == 0 and nvml.calls["nvmlEventSetWait_v2"] == 0
    assert len([r for r in caplog.records if "XIDs come from the kernel log" in r.message]) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    backend.close()


def test_auto_registers_xid_only_on_the_gpus_the_kernel_log_cannot_name() -> None:
    nvml = _every_kind()
    backend = _backend("auto", nvml)
    backend.kernel_log_covers({0})
    backend.wait_events(0)
    assert nvml.event_sets[0].masks == {1: XID}
    backend.close()


def test_all_and_xid_keep_their_set_beside_the_kernel_log() -> None:
    for mode, mask in (("all", XID | DBE | SBE), ("xid", XID)):
        nvml = _every_kind()
        backend = _backend(mode, nvml)
        backend.kernel_log_covers({0, 1})
        backend.wait_events(0)
        assert nvml.event_sets[0].masks == {0: mask, 1: mask}, mode
        backend.close()


def test_hearing_of_the_kernel_log_late_frees_the_set_already_registered() -> None:
    nvml = _every_kind()
    backend = _backend("auto", nvml)
    backend.wait_events(0)
    assert nvml.event_sets[0].masks == {0: XID, 1: XID}
    backend.kernel_log_covers({0, 1})
    assert nvml.event_sets[0].freed
    backend.wait_events(0)
    assert len(nvml.event_sets) == 1 and nvml.calls["nvmlEventSetWait_v2"] == 1  # the one wait before
    backend.close()


def test_none_without_a_kernel_log_warns_that_xids_go_unseen(caplog: pytest.LogCaptureFixture) -> None:
    nvml = _every_kind()
    backend = _backend("none", nvml)
    backend.kernel_log_covers({0})
    with caplog.at_level(logging.WARNING, logger="gpuwatch.backends.nvml"):
        assert backend.wait_events(0) == []
    assert nvml.calls["nvmlEventSetCreate"] == 0
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["nvml.events = none and no kernel log for GPU(s) [1]: their XIDs are not seen"]
    backend.close()


def test_the_mode_is_kept_across_a_reset() -> None:
    nvml = _every_kind()
    backend = _backend("auto", nvml)
    backend.kernel_log_covers({0, 1})
    backend.wait_events(0)
    backend.reacquire()
    backend.wait_events(0)
    assert nvml.calls["nvmlEventSetCreate"] == 0
    backend.close()


def test_a_mode_not_known_is_one_line_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text('[nvml]\nevents = "some"\n')
    with pytest.raises(
        ConfigError, match=r"^nvml\.events: 'some' is not auto, xid, all or none \(in .*gpuwatch\.toml\)$"
    ):
        load(path, environ={})
    assert load(path, environ={"GPUWATCH_NVML_EVENTS": "all"}).nvml.events == "all"


def _kernel_line(bus: str, xid: int) -> str:
    """A /dev/kmsg record written now (its timestamp counts from boot on the monotonic clock)."""
    usec = round(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
    return f"3,1,{usec},-;NVRM: Xid (PCI:{bus}): {xid}, pid=4242, name=python3, Ch 00000008\n"


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "sets"), [("auto", 0), ("xid", 1)])
def test_the_daemon_judges_a_kernel_log_xid_at_once_without_an_event_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, sets: int
) -> None:
    """On the fake NVML, sampling every 30 s: XID 48 (a double-bit error) written to the kernel log makes
    the GPU unhealthy within the event deadline, so through the event path, not a sample; under auto
    no NVML event set is ever created, under xid one is, for XIDs only."""
    from gpuwatch.daemon import Daemon
    from tests.helpers import sim_config

    nvml = FakeNvml([dataclasses.replace(gpu, remapped=(0, 0, 0, 0)) for gpu in two_gpus()])  # healthy cards
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    overrides = {"tools.kmsg": str(kmsg), "nvml.events": mode}
    config = sim_config(tmp_path, gpus=2, backend="nvml", interval_s=30.0, **overrides)
    daemon = Daemon(config)
    daemon.start()
    try:
        time.sleep(0.3)  # the event thread's first waits
        assert daemon.monitor.kernel_log_readable is True
        assert [g.state.value for g in daemon.monitor.snapshot.gpus] == ["healthy", "healthy"]
        with kmsg.open("a") as log:
            log.write(_kernel_line("0000:00:07", 48))
        deadline = time.monotonic() + config.drills.event_detect_timeout_s + 1.0
        while time.monotonic() < deadline:
            gpu = daemon.monitor.snapshot.gpu(1)
            if gpu is not None and gpu.state.value == "unhealthy":
                break
            time.sleep(0.05)
        gpu = daemon.monitor.snapshot.gpu(1)
        assert gpu is not None and gpu.state.value == "unhealthy", gpu
        assert "xid_critical" in {f.rule for f in gpu.findings}
        assert daemon.monitor.snapshot.gpu(0).state.value == "healthy"  # type: ignore[union-attr]
        assert nvml.calls["nvmlEventSetCreate"] == sets
        assert [s.masks for s in nvml.event_sets] == [{0: XID, 1: XID}] * sets
    finally:
        daemon.stop()
