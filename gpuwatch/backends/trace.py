"""Trace files, version 1: the reader the replay backend uses and the writer `record` uses.

The format is documented in docs/trace-format.md: JSON lines; line 1 is the header
`{"format": "gpuwatch-trace", "version": 1, "note": ..., "static": [GpuStatic fields per GPU]}`;
every other line is one GPU at time `t` (Unix seconds): a sample (GpuSample's fields, any of them
null or absent), an event (`"event": "xid" | "ecc_dbe" | "ecc_sbe"`, `"xid": N`), or an error
(`"error": "gpu_lost" | "reset_required" | "unknown"`).

Stdlib only. Every malformed thing raises TraceError with one line `FILE:LINE: what is wrong`, so a
bad trace is fixed from the message alone. Unknown fields are ignored: later versions may add some.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from gpuwatch.errors import TraceError
from gpuwatch.model import ERROR_KINDS, EVENT_KINDS, GpuError, GpuEvent, GpuSample, GpuStatic, Reading

FORMAT = "gpuwatch-trace"
VERSION = 1


def _field_types(cls: type) -> dict[str, type]:
    """Field → int | float | str for the scalar fields of a model dataclass (None is always allowed)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, type] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if hint in (int, float, str):
            out[f.name] = hint
    return out


# Field name → the JSON type it must have; from the dataclasses so a field added to model.py is checked too.
_SAMPLE_TYPES = _field_types(GpuSample)
_STATIC_TYPES = _field_types(GpuStatic)
_KEY_FIELDS = ("t", "index", "uuid")


@dataclass(frozen=True)
class Trace:
    """A whole trace file: the header's per-GPU facts, its note, and every reading in file order."""

    statics: tuple[GpuStatic, ...]
    note: str
    readings: tuple[Reading, ...]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check(name: str, value: Any, want: type, *, nullable: bool = True) -> Any:
    """`value` if it has JSON type `want` (an int counts as a float, a bool as neither), else TraceError."""
    if value is None and nullable:
        return None
    ok = not isinstance(value, bool) and (isinstance(value, want) or (want is float and isinstance(value, int)))
    if not ok:
        label = {int: "an integer", float: "a number", str: "a string"}[want]
        raise TraceError(f"field {name!r} is not {label}: {json.dumps(value)}")
    return float(value) if want is float else value


def reading_from_dict(data: Mapping[str, Any], indexes: Collection[int] | None = None) -> Reading:
    """Build a sample, event or error from one decoded trace line.

    Args:
        data: the JSON object of the line.
        indexes: the GPU indexes of the header; None accepts any index.

    Raises:
        TraceError: what is wrong, without file or line (read_trace adds them).
    """
    for key in _KEY_FIELDS:
        if key not in data:
            raise TraceError(f"reading has no {key!r} field")
    t = _check("t", data["t"], float, nullable=False)
    index = _check("index", data["index"], int, nullable=False)
    uuid = _check("uuid", data["uuid"], str, nullable=False)
    if indexes is not None and index not in indexes:
        known = ", ".join(str(i) for i in sorted(indexes)) or "none"
        raise TraceError(f"GPU index {index} is not in the header (indexes: {known})")
    if "event" in data:
        kind = data["event"]
        if kind not in EVENT_KINDS:
            raise TraceError(f"unknown event kind {json.dumps(kind)} (known: {', '.join(EVENT_KINDS)})")
        xid = _check("xid", data.get("xid"), int)
        if kind == "xid" and xid is None:
            raise TraceError("xid event without an 'xid' number")
        return GpuEvent(t=t, index=index, uuid=uuid, kind=kind, xid=xid)
    if "error" in data:
        kind = data["error"]
        if kind not in ERROR_KINDS:
            raise TraceError(f"unknown error kind {json.dumps(kind)} (known: {', '.join(ERROR_KINDS)})")
        return GpuError(t=t, index=index, uuid=uuid, kind=kind)
    values: dict[str, Any] = {"t": t, "index": index, "uuid": uuid}
    for name, want in _SAMPLE_TYPES.items():
        if name not in _KEY_FIELDS and name in data:
            values[name] = _check(name, data[name], want)
    pids = data.get("pids")
    if pids is not None:
        if not isinstance(pids, list) or any(isinstance(p, bool) or not isinstance(p, int) for p in pids):
            raise TraceError(f"field 'pids' is not a list of integers: {json.dumps(pids)}")
        values["pids"] = tuple(pids)
    return GpuSample(**values)


def reading_to_dict(reading: Reading) -> dict[str, Any]:
    """The JSON object of one trace line: a flat sample, `{t,index,uuid,event,xid}` or `{t,index,uuid,error}`."""
    if isinstance(reading, GpuSample):
        out = asdict(reading)
        out["pids"] = list(reading.pids)
        return out
    head: dict[str, Any] = {"t": reading.t, "index": reading.index, "uuid": reading.uuid}
    if isinstance(reading, GpuEvent):
        return {**head, "event": reading.kind, "xid": reading.xid}
    return {**head, "error": reading.kind}


def _static_from_dict(data: Any) -> GpuStatic:
    if not isinstance(data, dict):
        raise TraceError(f"header 'static' entry is not an object: {json.dumps(data)}")
    for key in ("index", "uuid"):
        if key not in data:
            raise TraceError(f"header 'static' entry has no {key!r} field")
    _check("index", data["index"], int, nullable=False)
    _check("uuid", data["uuid"], str, nullable=False)
    values = {name: _check(name, data[name], want) for name, want in _STATIC_TYPES.items() if name in data}
    return GpuStatic(**values)


def _parse_header(line: str) -> tuple[tuple[GpuStatic, ...], str]:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"header is not JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise TraceError("header is nested too deeply to be a trace header") from None
    if not isinstance(data, dict) or "static" not in data:
        raise TraceError(f'header missing: line 1 must be {{"format": "{FORMAT}", "version": {VERSION}, ...}}')
    if data.get("format") != FORMAT:
        raise TraceError(f"not a {FORMAT} file (header format is {json.dumps(data.get('format'))})")
    if data.get("version") != VERSION:
        raise TraceError(f"unsupported trace version {json.dumps(data.get('version'))} (this gpuwatch reads {VERSION})")
    if not isinstance(data["static"], list):
        raise TraceError("header 'static' is not a list")
    statics = tuple(_static_from_dict(entry) for entry in data["static"])
    seen = [s.index for s in statics]
    if len(set(seen)) != len(seen):
        raise TraceError(f"header lists a GPU index twice: {seen}")
    note = _check("note", data.get("note", ""), str, nullable=False)
    return statics, note


def read_trace(path: str | Path) -> Trace:
    """Read and validate a whole trace file.

    Raises:
        TraceError: `FILE:LINE: what is wrong` for the first malformed line (or an unreadable file).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read trace: {getattr(exc, 'strerror', None) or exc}") from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}:1: header missing: the file is empty or starts with a blank line")
    try:
        statics, note = _parse_header(lines[0])
    except TraceError as exc:
        raise TraceError(f"{path}:1: {exc}") from None
    indexes = {s.index for s in statics}
    readings: list[Reading] = []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"not JSON: {exc.msg} (column {exc.colno})") from None
            except RecursionError:
                raise TraceError("nested too deeply to be a reading") from None
            if not isinstance(data, dict):
                raise TraceError(f"expected a JSON object, got {_type_name(data)}")
            readings.append(reading_from_dict(data, indexes))
        except TraceError as exc:
            raise TraceError(f"{path}:{number}: {exc}") from None
    return Trace(statics=statics, note=note, readings=tuple(readings))


class TraceWriter:
    """Writes a trace line by line, flushing each, so a crash or kill loses at most the line being written.

    Usage: `with TraceWriter(path, statics, note) as w: w.write(sample)`.
    """

    def __init__(self, path: str | Path, statics: tuple[GpuStatic, ...] | list[GpuStatic], note: str = "") -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("w", encoding="utf-8")
        header = {"format": FORMAT, "version": VERSION, "note": note, "static": [asdict(s) for s in statics]}
        self._line(header)

    def _line(self, data: dict[str, Any]) -> None:
        self._file.write(json.dumps(data) + "\n")
        self._file.flush()

    def write(self, reading: Reading) -> None:
        self._line(reading_to_dict(reading))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
