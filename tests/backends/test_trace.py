"""Trace files: round trip, the real H200 trace, and one clear line for every malformed input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatch.backends.trace import TraceWriter, read_trace, reading_from_dict, reading_to_dict
from gpuwatch.errors import TraceError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic
from tests.helpers import HEALTHY_TRACE

SHARED_TRACE = HEALTHY_TRACE  # the real H200 trace of shared/traces, committed under tests/data
UUID0 = "GPU-00000000-0000-0000-0000-000000000000"
UUID1 = "GPU-11111111-1111-1111-1111-111111111111"
STATICS = (
    GpuStatic(index=0, uuid=UUID0, name="NVIDIA H200", pci_bus_id="00000000:18:00.0", max_sm_clock_mhz=1980),
    GpuStatic(index=1, uuid=UUID1, name="NVIDIA H200", pci_bus_id="00000000:2A:00.0", power_limit_w=700.0),
)
HEADER = json.dumps({"format": "gpuwatch-trace", "version": 1, "static": [{"index": 0, "uuid": UUID0}]})


def full_sample(t: float, index: int, uuid: str) -> GpuSample:
    return GpuSample(
        t=t,
        index=index,
        uuid=uuid,
        sm_clock_mhz=1455,
        mem_clock_mhz=3201,
        power_w=691.83,
        temp_c=56,
        mem_temp_c=47,
        util_gpu_pct=100,
        util_mem_pct=24,
        memory_used_bytes=3986554880,
        clocks_event_reasons=4,
        pstate=0,
        energy_mj=9003498,
        violation_power_ns=6114586464,
        violation_thermal_ns=0,
        ecc_sbe_volatile=0,
        ecc_dbe_volatile=0,
        ecc_sbe_aggregate=3,
        ecc_dbe_aggregate=0,
        remapped_cor=0,
        remapped_unc=0,
        remapped_pending=0,
        remapped_failure=0,
        pcie_replay=0,
        power_instant_mw=885573,
        pids=(481, 522),
    )


def test_round_trip(tmp_path: Path) -> None:
    readings = (
        full_sample(1796037709.086, 0, UUID0),
        GpuSample(t=1796037709.1, index=1, uuid=UUID1, power_w=80.0),
        GpuEvent(t=1796037709.5, index=1, uuid=UUID1, kind="xid", xid=79),
        GpuEvent(t=1796037709.6, index=0, uuid=UUID0, kind="ecc_dbe"),
        GpuError(t=1796037710.0, index=1, uuid=UUID1, kind="gpu_lost"),
    )
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, STATICS, note="round trip") as writer:
        for reading in readings:
            writer.write(reading)
    trace = read_trace(path)
    assert trace.statics == STATICS
    assert trace.note == "round trip"
    assert trace.readings == readings


def test_writer_flushes_each_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with TraceWriter(path, STATICS) as writer:
        assert len(path.read_text().splitlines()) == 1
        writer.write(full_sample(1.0, 0, UUID0))
        assert len(path.read_text().splitlines()) == 2


def test_line_shapes() -> None:
    sample = reading_to_dict(full_sample(1.0, 0, UUID0))
    assert sample["pids"] == [481, 522]
    assert set(sample) >= {"t", "index", "uuid", "sm_clock_mhz", "energy_mj", "remapped_failure", "power_instant_mw"}
    event = reading_to_dict(GpuEvent(t=1.0, index=0, uuid=UUID0, kind="xid", xid=31))
    assert event == {"t": 1.0, "index": 0, "uuid": UUID0, "event": "xid", "xid": 31}
    error = reading_to_dict(GpuError(t=1.0, index=0, uuid=UUID0, kind="reset_required"))
    assert error == {"t": 1.0, "index": 0, "uuid": UUID0, "error": "reset_required"}
    assert reading_from_dict(json.loads(json.dumps(event))) == GpuEvent(t=1.0, index=0, uuid=UUID0, kind="xid", xid=31)


def test_unknown_fields_are_ignored(tmp_path: Path) -> None:
    header = {"format": "gpuwatch-trace", "version": 1, "later": True, "static": [{"index": 0, "uuid": UUID0, "x": 1}]}
    line = {"t": 5, "index": 0, "uuid": UUID0, "power_w": 90, "nvlink_crc": 7}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n\n")
    trace = read_trace(path)
    assert trace.readings == (GpuSample(t=5.0, index=0, uuid=UUID0, power_w=90.0),)
    assert trace.note == ""


def test_shared_healthy_trace_parses() -> None:
    assert SHARED_TRACE is not None
    assert len(SHARED_TRACE.read_text().splitlines()) == 241
    trace = read_trace(SHARED_TRACE)
    assert len(trace.statics) == 1 and trace.statics[0].name == "NVIDIA H200"
    assert trace.statics[0].memory_total_bytes == 150754820096
    assert "H200" in trace.note
    assert len(trace.readings) == 240
    assert all(isinstance(r, GpuSample) for r in trace.readings)
    times = [r.t for r in trace.readings]
    assert times == sorted(times)
    assert {r.clocks_event_reasons for r in trace.readings if isinstance(r, GpuSample)} == {0, 1, 4}


def reading(**fields: object) -> str:
    return json.dumps({"t": 1.5, "index": 0, "uuid": UUID0, **fields})


BAD = [
    ("", 1, "header missing"),
    ("not json\n", 1, "header is not JSON"),
    (reading() + "\n", 1, "header missing"),
    (
        json.dumps({"format": "other", "version": 1, "static": []}),
        1,
        'not a gpuwatch-trace file (header format is "other")',
    ),
    (json.dumps({"version": 1, "static": []}), 1, "not a gpuwatch-trace file"),
    (json.dumps({"format": "gpuwatch-trace", "version": 2, "static": []}), 1, "unsupported trace version 2"),
    (json.dumps({"format": "gpuwatch-trace", "version": 1, "static": {}}), 1, "'static' is not a list"),
    (json.dumps({"format": "gpuwatch-trace", "version": 1, "static": [{"uuid": UUID0}]}), 1, "has no 'index'"),
    (
        json.dumps({"format": "gpuwatch-trace", "version": 1, "static": [{"index": 0, "uuid": 5}]}),
        1,
        "field 'uuid' is not a string",
    ),
    (HEADER + "\n" + reading() + "\n{oops\n", 3, "not JSON"),
    (HEADER + "\n[1, 2]\n", 2, "expected a JSON object, got list"),
    (HEADER + '\n{"index": 0, "uuid": "u"}\n', 2, "reading has no 't' field"),
    (HEADER + '\n{"t": 1, "uuid": "u"}\n', 2, "reading has no 'index' field"),
    (HEADER + '\n{"t": 1, "index": 0}\n', 2, "reading has no 'uuid' field"),
    (HEADER + "\n" + reading(t="soon") + "\n", 2, "field 't' is not a number"),
    (HEADER + "\n" + reading(t=True) + "\n", 2, "field 't' is not a number"),
    (HEADER + "\n" + reading(index=3) + "\n", 2, "GPU index 3 is not in the header (indexes: 0)"),
    (HEADER + "\n" + reading(event="melted") + "\n", 2, 'unknown event kind "melted" (known: xid, ecc_dbe, ecc_sbe)'),
    (HEADER + "\n" + reading(event="xid") + "\n", 2, "xid event without an 'xid' number"),
    (HEADER + "\n" + reading(event="xid", xid="79") + "\n", 2, "field 'xid' is not an integer"),
    (HEADER + "\n" + reading(error="oops") + "\n", 2, 'unknown error kind "oops"'),
    (HEADER + "\n" + reading(sm_clock_mhz="1980") + "\n", 2, "field 'sm_clock_mhz' is not an integer: \"1980\""),
    (HEADER + "\n" + reading(temp_c=35.5) + "\n", 2, "field 'temp_c' is not an integer"),
    (HEADER + "\n" + reading(power_w="high") + "\n", 2, "field 'power_w' is not a number"),
    (HEADER + "\n" + reading(pids=[1, "2"]) + "\n", 2, "field 'pids' is not a list of integers"),
]


@pytest.mark.parametrize(("content", "line", "message"), BAD, ids=[b[2][:40] for b in BAD])
def test_bad_input_gives_one_line(tmp_path: Path, content: str, line: int, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"{path}:{line}: ")
    assert message in text


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_the_format_doc_in_the_repository_names_every_field_and_kind() -> None:
    """docs/trace-format.md is what `record --help` points at; it must keep up with the model."""
    from dataclasses import fields

    from click.testing import CliRunner

    from gpuwatch.backends.trace import FORMAT, VERSION
    from gpuwatch.cli import main
    from gpuwatch.model import ERROR_KINDS, EVENT_KINDS

    doc = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
    text = doc.read_text()
    assert f'"format": "{FORMAT}", "version": {VERSION}' in text
    named = {f.name for cls in (GpuSample, GpuStatic) for f in fields(cls)} | set(ERROR_KINDS) | set(EVENT_KINDS)
    assert [name for name in sorted(named) if f"`{name}`" not in text and f'"{name}"' not in text] == []
    assert "docs/trace-format.md" in " ".join(CliRunner().invoke(main, ["record", "--help"]).output.split())
