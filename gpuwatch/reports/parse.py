"""A report message as a TrainerInfo, every field checked: its sender is any local account.

A bad field rejects the whole report with one message naming the field and what is wrong; nothing
here raises anything but ReportError, whatever the bytes are.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gpuwatch.model import TrainerInfo
from gpuwatch.trainer.contract import ENDED_VALUES, RECOVERY_VALUES, SPARE_STAGES

_MAX_INT = 1 << 62
_MAX_TEXT = 256


class ReportError(ValueError):
    """A report that is not one: the message names the field and what is wrong."""


def _int(low: int, high: int) -> Any:
    def check(value: Any) -> int:
        if type(value) is not int or not low <= value <= high:
            raise ReportError(f"expected an integer in [{low}, {high}], got {_short(value)}")
        return value

    return check


def _number(value: Any) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ReportError(f"expected a finite number >= 0, got {_short(value)}")
    return float(value)


def _text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT or not value.isprintable():
        raise ReportError(f"expected printable text of at most {_MAX_TEXT} characters, got {_short(value)}")
    return value


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ReportError(f"expected true or false, got {_short(value)}")
    return value


def _one_of(values: tuple[str, ...]) -> Any:
    def check(value: Any) -> str:
        if value not in values:
            raise ReportError(f"expected one of {', '.join(values)}, got {_short(value)}")
        return str(value)

    return check


_COUNT = _int(0, _MAX_INT)
_RANK = _int(0, 1 << 20)
# Each field of a TrainerReport but `t` and `pid`, and its check; null is always allowed. Others are ignored.
_FIELDS: dict[str, Any] = {
    "rank": _RANK,
    "local_rank": _RANK,
    "world_size": _int(1, 1 << 20),
    "local_world_size": _int(1, 1 << 20),
    "job_id": _text,
    "gpu_uuid": _text,
    "step": _COUNT,
    "first_step": _COUNT,
    "first_step_t": _number,
    "step_t": _number,
    "step_time_s": _number,
    "step_time_p99_s": _number,
    "grad_norm": _number,
    "grad_norm_var": _number,
    "reserved_bytes": _COUNT,
    "allocated_bytes": _COUNT,
    "inactive_split_bytes": _COUNT,
    "num_alloc_retries": _COUNT,
    "num_ooms": _COUNT,
    "stop_requested": _flag,
    "allow_drills": _flag,
    "spare": _flag,
    "spare_stage": _one_of(SPARE_STAGES),
    "recovery": _one_of(RECOVERY_VALUES),
    "ended": _one_of(ENDED_VALUES),
    "pause": _text,
    "pause_until": _number,
}


def parse_report(data: bytes, pid: int) -> TrainerInfo:
    """One report's bytes as a TrainerInfo of process `pid` (the kernel's word for the sender), every field checked.

    Raises:
        ReportError: naming the first bad field (or the JSON error).
    """
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: '[' * 60000 is valid-looking JSON
        raise ReportError(f"not JSON: {str(exc)[:80] or type(exc).__name__}") from None
    if not isinstance(body, dict):
        raise ReportError("not a JSON object")
    if body.get("pid") != pid or type(body.get("pid")) is not int:
        raise ReportError(f"pid: {_short(body.get('pid'))} is not the sender's pid {pid}")
    try:
        updated = _number(body.get("t"))
    except ReportError as exc:
        raise ReportError(f"t: {exc}") from None
    values: dict[str, Any] = {}
    for name, check in _FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        try:
            values[name] = check(value)
        except ReportError as exc:
            raise ReportError(f"{name}: {exc}") from None
    return TrainerInfo(pid=pid, updated_t=updated, **values)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
