"""The kernel log as an XID source: parsing real NVRM lines, replay at start, following, no access, de-duplication."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest

from gpuwatch.backends.kmsg import KernelLog, parse_record, pci_key
from gpuwatch.backends.sim import SimBackend
from gpuwatch.base.clock import ManualClock
from gpuwatch.model import GpuEvent, GpuStatic
from gpuwatch.node.monitor import Monitor
from tests.helpers import T0, sim_config

BOOT = 1_800_000_000.0
# As the driver writes them (the first as on the lab's H200, DESIGN.md), behind /dev/kmsg's "PRI,SEQ,USEC,FLAGS;".
XID31 = (
    "NVRM: Xid (PCI:0000:18:00): 31, pid=4242, name=python3, Ch 00000008, intr 10000000. MMU Fault: ENGINE "
    "GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2b_c0000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
)
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID13_OLD = "NVRM: Xid (PCI:0000:18:00.0): 13, Graphics SM Warp Exception on (GPC 1, TPC 0, SM 0): Out Of Range Address"
SXID = "nvidia-nvswitch2: SXid (PCI:0000:87:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"

STATICS = (
    GpuStatic(index=0, uuid="GPU-a", pci_bus_id="00000000:18:00.0"),
    GpuStatic(index=1, uuid="GPU-b", pci_bus_id="00000000:3B:00.0"),
)


def record(seq: int, usec: int, text: str) -> str:
    return f"4,{seq},{usec},-;{text}\n"


def test_parse_real_lines() -> None:
    xid = parse_record(record(1, 2_500_000, XID31).rstrip("\n"), BOOT)
    assert xid is not None and (xid.t, xid.pci, xid.xid, xid.sxid) == (BOOT + 2.5, "0000:18:00", 31, False)
    assert xid.line == XID31
    assert parse_record(record(2, 1, XID79), BOOT).xid == 79  # type: ignore[union-attr]
    assert parse_record(record(3, 1, XID13_OLD), BOOT).pci == "0000:18:00"  # type: ignore[union-attr]
    sxid = parse_record(record(4, 1, SXID), BOOT)
    assert sxid is not None and (sxid.xid, sxid.sxid) == (20034, True)
    for other in ("6,5,1,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04", "garbage", "4,x,y;NVRM: Xid"):
        assert parse_record(other, BOOT) is None


def test_pci_keys_of_nvml_and_the_log_agree() -> None:
    assert pci_key("00000000:3B:00.0") == pci_key("0000:3b:00") == "0000:3b:00"


def test_replay_maps_bus_ids_to_gpus_and_counts_sxids(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    lines = [record(1, 5_000_000, XID31), "  SUBSYSTEM=pci\n", record(2, 6_000_000, XID79), record(3, 7_000_000, SXID)]
    lines.append(record(4, 8_000_000, "NVRM: Xid (PCI:0000:99:00): 31, pid=1, name=x"))  # not our GPU
    path.write_text("".join(lines))
    kernel_log = KernelLog(str(path), STATICS, boot_t=BOOT)
    assert kernel_log.open() and kernel_log.readable
    events = kernel_log.read_available()
    assert [(e.index, e.xid, e.t, e.source) for e in events] == [(0, 31, BOOT + 5, "kmsg"), (1, 79, BOOT + 6, "kmsg")]
    assert kernel_log.sxids_total == 1
    assert kernel_log.read_available() == []
    kernel_log.close()


def test_follows_a_fifo_including_a_line_split_across_writes(tmp_path: Path) -> None:
    path = tmp_path / "kmsg.fifo"
    os.mkfifo(path)
    kernel_log = KernelLog(str(path), STATICS, boot_t=BOOT)
    assert kernel_log.open()
    writer = os.open(path, os.O_WRONLY)
    got: list[GpuEvent] = []
    arrived = threading.Event()
    stop = threading.Event()

    def handle(events: list[GpuEvent]) -> None:
        got.extend(events)
        arrived.set()

    thread = threading.Thread(target=kernel_log.follow, args=(stop, handle, 0.05))
    thread.start()
    try:
        line = record(9, 1_000_000, XID31).encode()
        os.write(writer, line[:30])
        os.write(writer, line[30:])
        assert arrived.wait(5)
        assert [(e.index, e.xid) for e in got] == [(0, 31)]
    finally:
        stop.set()
        thread.join(5)
        os.close(writer)
        kernel_log.close()


def test_no_access_is_a_state_not_an_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kernel_log = KernelLog(str(tmp_path / "missing"), STATICS, boot_t=BOOT)
    assert kernel_log.open() is False
    assert kernel_log.readable is False and kernel_log.read_available() == []
    assert "not readable" in caplog.text


def _monitor(tmp_path: Path, clock: ManualClock) -> Monitor:
    config = sim_config(tmp_path, gpus=2)
    backend = SimBackend(config, clock=clock)
    monitor = Monitor(backend, backend.open(), config, clock=clock)
    monitor.tick()
    return monitor


def test_an_old_xid_outside_every_window_is_listed_but_raises_no_alarm(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    monitor = _monitor(tmp_path, clock)
    uuid = monitor.statics[1].uuid
    old = GpuEvent(clock.t - 7200, 1, uuid, "xid", 79, source="kmsg", detail=XID79)  # before start, 2 h ago
    snapshot = monitor.handle_events([old])
    assert snapshot is not None
    gpu = snapshot.gpu(1)
    assert gpu is not None and gpu.state.value == "healthy" and gpu.findings == ()
    assert [(e.xid, e.t, e.detail) for e in gpu.kernel_xids] == [(79, clock.t - 7200, XID79)]
    recent = GpuEvent(clock.t - 60, 1, uuid, "xid", 79, source="kmsg", detail=XID79)  # within xid_window_s
    gpu = monitor.handle_events([recent]).gpu(1)  # type: ignore[union-attr]
    assert gpu is not None and "xid_critical" in {f.rule for f in gpu.findings}


def test_an_xid_from_both_sources_counts_once(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    monitor = _monitor(tmp_path, clock)
    uuid = monitor.statics[0].uuid
    nvml = GpuEvent(clock.t, 0, uuid, "xid", 31)
    kernel = dataclasses.replace(nvml, t=clock.t - 0.3, source="kmsg", detail=XID31, pid=4242)
    monitor.handle_events([nvml])
    monitor.handle_events([kernel])  # the same fault: not counted again, but its pid joins the NVML event
    assert monitor.snapshot.gpu(0).xid_counts == ((31, 1),)  # type: ignore[union-attr]
    assert [(e.source, e.pid) for e in monitor.snapshot.gpu(0).xid_events] == [("nvml", 4242)]  # type: ignore[union-attr]
    assert len(monitor.snapshot.gpu(0).kernel_xids) == 1  # type: ignore[union-attr]  # still listed
    # a second fault (another NVML event, its own kernel line) is a second XID
    monitor.handle_events([dataclasses.replace(nvml, t=clock.t + 20)])
    monitor.handle_events([dataclasses.replace(kernel, t=clock.t + 20.1)])
    monitor.handle_events([dataclasses.replace(kernel, t=clock.t + 60)])  # only in the kernel log: counts
    assert monitor.snapshot.gpu(0).xid_counts == ((31, 3),)  # type: ignore[union-attr]


@pytest.mark.parametrize(("readable", "value"), [(False, 0.0), (True, 1.0)])
def test_kernel_log_access_is_exported(tmp_path: Path, readable: bool, value: float) -> None:
    from gpuwatch.serving.metrics import SnapshotCollector, text_exposition
    from tests.helpers import metric_samples

    clock = ManualClock(T0)
    monitor = _monitor(tmp_path, clock)
    monitor.kernel_log_readable, monitor.kernel_sxids_total = readable, 2
    monitor.tick()
    text = text_exposition(SnapshotCollector(lambda: monitor.snapshot).collect()).decode()
    assert [v for _, v in metric_samples(text, "gpuwatch_kernel_log_readable")] == [value]
    assert [v for _, v in metric_samples(text, "gpuwatch_kernel_sxid_errors_total")] == [2.0]


def test_an_old_kernel_xid_is_not_counted_for_the_alerts(tmp_path: Path) -> None:
    """gpuwatch_gpu_xid_errors_total feeds GpuwatchXidCritical: an XID 79 from boot must not appear in it."""
    clock = ManualClock(T0)
    monitor = _monitor(tmp_path, clock)
    old = GpuEvent(clock.t - 7200, 0, monitor.statics[0].uuid, "xid", 79, source="kmsg", detail=XID79)
    monitor.handle_events([old])
    assert monitor.snapshot.gpu(0).xid_counts == ()  # type: ignore[union-attr]


def test_the_daemon_replays_the_kernel_log_at_start(tmp_path: Path) -> None:
    """Wired as on a live backend: an old XID is listed with its kernel time, a recent one is judged."""
    from tests.helpers import metric_samples, start_sim_node

    node = start_sim_node(tmp_path, gpus=2)
    try:
        daemon = node.daemon
        statics = list(daemon.monitor.statics.values())
        bus = [pci_key(s.pci_bus_id) for s in statics]
        path = tmp_path / "kmsg"
        now_usec = round((node.clock.t - BOOT) * 1e6)
        path.write_text(
            record(1, now_usec - 7_200_000_000, f"NVRM: Xid (PCI:{bus[0]}): 79, pid='<unknown>', name=<unknown>")
            + record(2, now_usec - 30_000_000, f"NVRM: Xid (PCI:{bus[1]}): 79, pid='<unknown>', name=<unknown>")
        )
        daemon.kernel_log = KernelLog(str(path), statics, boot_t=BOOT)
        daemon._start_kernel_log()
        old, recent = node.gpu(0), node.gpu(1)
        assert [x["xid"] for x in old["kernel_xids"]] == [79] and old["state"] == "healthy"
        assert old["kernel_xids"][0]["t"] == pytest.approx(node.clock.t - 7200)
        assert recent["state"] == "unhealthy" and "xid_critical" in {f["rule"] for f in recent["findings"]}
        node.run_for(5)
        assert [v for _, v in metric_samples(node.client.get("/metrics").text, "gpuwatch_kernel_log_readable")] == [1]
    finally:
        node.daemon.stop_event.set()
        if node.daemon._kernel_thread is not None:
            node.daemon._kernel_thread.join(5)
        if node.daemon.kernel_log is not None:
            node.daemon.kernel_log.close()
        node.close()


def test_status_lists_kernel_xids_with_their_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from gpuwatch.cli import main
    from gpuwatch.serving.client import DaemonClient
    from gpuwatch.serving.wire import GpuList

    gpu = {"index": 0, "uuid": "GPU-a", "state": "healthy", "quarantined": False, "findings": [], "sample": None}
    gpu |= {"suggested_action": "none", "kernel_xids": [{"t": BOOT, "xid": 31, "line": XID31}]}
    listed = GpuList.model_validate({"t": BOOT, "backend": "nvml", "gpus": [gpu]})
    monkeypatch.setattr(DaemonClient, "gpu_list", lambda self: listed)
    result = CliRunner().invoke(main, ["status", "--state-dir", str(tmp_path)], terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "GPU 0 kernel log 2027-01-15 08:00:00 UTC: XID 31: NVRM: Xid (PCI:0000:18:00): 31, pid=4242" in result.output


def test_the_faulting_pid_is_read_from_the_line_and_unknown_stays_unknown() -> None:
    assert parse_record(record(1, 5, XID31), BOOT).pid == 4242  # type: ignore[union-attr]
    assert parse_record(record(2, 5, XID79), BOOT).pid is None  # type: ignore[union-attr]
