"""A drill's injection: sample fields that override one GPU's readings for a while, checked before they count.

The monitor lays an injection over the GPU's readings (and marks what the rules find meanwhile as a drill);
here is what an injection is and what may be injected. A wrong type reaching the rules would raise on every
tick for every GPU, so nothing unchecked gets into the overlay.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.model import ERROR_KINDS, SAMPLE_FIELDS, GpuEvent, GpuSample

# Sample fields a drill may override, plus `error` (a read error kind: gpu_lost, reset_required, unknown).
_INJECTABLE = (frozenset(SAMPLE_FIELDS) - {"t", "index", "uuid"}) | {"error"}

_SAMPLE_HINTS = typing.get_type_hints(GpuSample)
_MAX_INT = 2**63 - 1  # what SQLite and every exporter take; larger "counters" are an attack, not a GPU


def checked_injection(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The injected fields, each checked against its sample field's type and range.

    A wrong type reaching the rules would raise on every tick for every GPU, so nothing unchecked
    gets into the overlay: ints stay ints (3.0 is 3), numbers are finite and non-negative,
    percentages at most 100, `error` one of the known kinds, None means "not read".

    Raises:
        ConfigError: naming the first bad field.
    """
    unknown = set(fields) - _INJECTABLE
    if unknown:
        raise ConfigError(f"inject: unknown field(s) {', '.join(_show(n) for n in sorted(unknown))}")
    return {name: _checked_value(name, value) for name, value in fields.items()}


def _show(value: Any) -> str:
    """A client's value for an error line: repr (escapes control characters and lone surrogates), cut short."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _checked_value(name: str, value: Any) -> Any:
    if value is None:
        return None
    if name == "error":
        if value not in ERROR_KINDS:
            raise ConfigError(f"inject: field error: {_show(value)} is not one of {', '.join(ERROR_KINDS)}")
        return value
    hint = _SAMPLE_HINTS[name]
    if name == "pids":
        if not isinstance(value, (list, tuple)) or not all(_is_int(p) and 0 < p <= _MAX_INT for p in value):
            raise ConfigError(f"inject: field pids: {_show(value)} is not a list of process ids")
        return tuple(value)
    wanted = next(a for a in typing.get_args(hint) if a is not type(None)) if typing.get_args(hint) else hint
    if wanted is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"inject: field {name}: {_show(value)} is not true or false")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
        raise ConfigError(f"inject: field {name}: {_show(value)} is not a finite number")
    if wanted is int:
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"inject: field {name}: {_show(value)} is not an integer")
        value = int(value)
    high = 100 if name.endswith("_pct") else _MAX_INT
    if not 0 <= value <= high:
        raise ConfigError(f"inject: field {name}: {_show(value)} is out of range (0 to {high})")
    return float(value) if wanted is float else value


def _finite(value: float) -> bool:
    return isinstance(value, int) or math.isfinite(value)  # an int may be too large for a float: the range says no


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Injection:
    """A drill's override of one GPU's readings until `until` (Unix seconds)."""

    id: int
    index: int
    fields: Mapping[str, Any]
    started: float
    until: float
    event: GpuEvent | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpu": self.index,
            "fields": dict(self.fields),
            "started": self.started,
            "until": self.until,
            "event": dataclasses.asdict(self.event) if self.event else None,
        }
