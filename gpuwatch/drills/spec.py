"""What drills exist and what a fault specification says: parsed strictly, so a typo never runs a drill.

An inject spec is `key=value` parts joined by commas: `gpu=1,sm_clock_mhz=500,for=600`. Keys are the
injectable sample fields, `error`, `event`, `xid`, `preset`, `for` (seconds), `expect` (the rule
that must fire) and `within` (its deadline). A DCGM spec is `gpu=0,field=230,value=79` plus
`expect` and `within`. From the fault the drill derives the rule it expects and how long that
rule's window needs, so a deadline means the same at any sampling interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.backends.dcgm import SAMPLE_FIELDS as DCGM_FIELDS
from gpuwatch.backends.dcgm import XID_FIELD
from gpuwatch.config import Config
from gpuwatch.errors import ConfigError
from gpuwatch.health.engine import ALL_RULE_IDS
from gpuwatch.health.rules.clocks import EXPLAINS_LOW_CLOCK, LOW_CLOCK_RULE, THROTTLE_RULES
from gpuwatch.health.xid_catalog import lookup
from gpuwatch.model import ERROR_KINDS, EVENT_KINDS, SAMPLE_FIELDS, Severity


@dataclass(frozen=True)
class Kind:
    """A drill kind: `needs_yes` drills do something real and dry-run without --yes; `destructive` ones
    touch the card or the bus and run on a schedule only with `allow_destructive`."""

    name: str
    option: str
    summary: str
    needs_yes: bool
    destructive: bool


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("inject", "--inject", "override readings or inject an event through the API", False, False),
        Kind("dcgm_inject", "--dcgm-inject", "dcgmi test --inject a value into DCGM's cache", False, False),
        Kind("xid_fault", "--xid-fault", "a sacrificial CUDA process raises a real, harmless XID 31", True, False),
        Kind("kill_rank", "--kill-rank", "SIGKILL one trainer rank on the GPU; the job must come back", True, False),
        Kind(
            "hang_rank",
            "--hang-rank",
            "SIGSTOP one trainer rank; the hang must be found, the job come back",
            True,
            False,
        ),
        Kind("fault_rank", "--fault-rank", "a rank that opted in raises a real XID 31 in its own context", True, False),
        Kind("reset_gpu", "--reset-gpu", "quarantine, trainers leave, nvidia-smi -r, burn in, release", True, True),
        Kind("pcie_remove", "--pcie-remove", "quarantine, trainers leave, sysfs remove + rescan, burn in", True, True),
        Kind(
            "validate", "--validate", "quarantine an idle GPU, run the GPU test, release only if it passes", True, False
        ),
    )
}

PRESETS: dict[str, dict[str, Any]] = {
    "clock_low": {"sm_clock_mhz": 500, "clocks_event_reasons": 0, "util_gpu_pct": 100},
    "xid79": {"event": "xid", "xid": 79},
    "ecc_dbe": {"event": "ecc_dbe"},
    "remap_pending": {"remapped_pending": 1},
    "gpu_lost": {"error": "gpu_lost"},
}
DEFAULT_DURATION_S = 600.0
FIELDS = frozenset(SAMPLE_FIELDS) - {"t", "index", "uuid", "pids"}
_INJECT_KEYS = ("gpu", "preset", "for", "event", "xid", "expect", "within", "error")
_DCGM_KEYS = ("gpu", "field", "value", "expect", "within")
_ERROR_RULES = {"gpu_lost": "gpu_lost", "reset_required": "gpu_reset_required", "unknown": "gpu_read_error"}


@dataclass(frozen=True)
class Expectation:
    """The rules a fault must raise (any of them; empty: any drill finding) and the window they need first."""

    rules: tuple[str, ...] = ()
    lag_s: float = 0.0
    event: bool = False  # judged at once (XID, ECC event) rather than at the next sample


@dataclass(frozen=True)
class InjectSpec:
    """A parsed --inject: what POST /v1/gpus/N/inject gets, and what must follow."""

    gpu: int | None
    fields: Mapping[str, Any] = field(default_factory=dict)
    duration_s: float = DEFAULT_DURATION_S
    event: str | None = None
    xid: int | None = None
    expect: str | None = None
    within_s: float | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"fields": dict(self.fields), "duration_s": self.duration_s}
        if self.event:
            body.update(event=self.event, xid=self.xid)
        return body


@dataclass(frozen=True)
class DcgmSpec:
    """A parsed --dcgm-inject: `dcgmi test --inject --gpuid N -f FIELD -v VALUE`."""

    gpu: int | None
    field_id: int
    value: float
    expect: str | None = None
    within_s: float | None = None


def parse_inject(text: str, where: str = "--inject", need_gpu: bool = True) -> InjectSpec:
    """Parse an inject spec.

    Raises:
        ConfigError: `where: ` and the part that is wrong.
    """
    parts = _parts(text, where, _INJECT_KEYS + tuple(sorted(FIELDS)))
    values: dict[str, Any] = {}
    if "preset" in parts:
        name = parts.pop("preset")
        if name not in PRESETS:
            raise ConfigError(f"{where}: preset={name}: unknown preset (known: {', '.join(PRESETS)})")
        values.update(PRESETS[name])
    for key, raw in parts.items():
        values[key] = _value(key, raw, where)
    gpu = _gpu(values.pop("gpu", None), where, need_gpu)
    duration = values.pop("for", DEFAULT_DURATION_S)
    expect, within = values.pop("expect", None), values.pop("within", None)
    xid = values.pop("xid", None)
    event = values.pop("event", "xid" if xid is not None else None)
    if event == "xid" and xid is None:
        raise ConfigError(f"{where}: event=xid needs xid=N")
    if xid is not None and event != "xid":
        raise ConfigError(f"{where}: xid={xid} goes with event=xid, not event={event}")
    if not values and event is None:
        raise ConfigError(f"{where}: nothing to inject: give sample fields, error=, event= or preset=")
    return InjectSpec(gpu, values, duration, event, xid, expect, within)


def parse_dcgm(text: str, where: str = "--dcgm-inject", need_gpu: bool = True) -> DcgmSpec:
    """Parse a DCGM injection spec.

    Raises:
        ConfigError: `where: ` and the part that is wrong.
    """
    parts = _parts(text, where, _DCGM_KEYS)
    for key in ("field", "value"):
        if key not in parts:
            raise ConfigError(f"{where}: {key}= is missing")
    values = {key: _value(key, raw, where) for key, raw in parts.items()}
    field_id = values["field"]
    if not isinstance(field_id, int) or field_id <= 0:
        raise ConfigError(f"{where}: field={parts['field']}: not a DCGM field id")
    gpu = _gpu(values.get("gpu"), where, need_gpu)
    return DcgmSpec(gpu, field_id, float(values["value"]), values.get("expect"), values.get("within"))


def expectation(spec: InjectSpec | DcgmSpec, config: Config) -> Expectation:
    """The rules the fault must raise and the part of their window that must pass first."""
    if isinstance(spec, DcgmSpec):
        found = _dcgm_expectation(spec, config)
        return Expectation((spec.expect,), found.lag_s, found.event) if spec.expect else found
    if spec.event == "xid" and spec.xid is not None:
        found = xid_expectation(spec.xid)
    elif spec.event == "ecc_dbe":
        found = Expectation(("ecc_uncorrectable",), event=True)
    elif spec.event is not None:
        found = Expectation(event=True)
    else:
        found = _fields_expectation(spec.fields, config)
    return Expectation((spec.expect,), found.lag_s, found.event) if spec.expect else found


def xid_expectation(xid: int) -> Expectation:
    if lookup(xid).severity is Severity.UNHEALTHY:
        return Expectation(("xid_critical",), event=True)
    return Expectation(("xid_app", "xid_app_repeated"), event=True)


def _fields_expectation(fields: Mapping[str, Any], config: Config) -> Expectation:
    rules = config.rules
    error = fields.get("error")
    if error:
        lag = config.interval_s if error == "unknown" else 0.0  # gpu_read_error needs two failed reads
        return Expectation((_ERROR_RULES[error],), lag)
    if fields.get("remapped_pending"):
        return Expectation(("row_remap_pending",))
    if fields.get("remapped_failure"):
        return Expectation(("row_remap_failure",))
    reasons = fields.get("clocks_event_reasons")
    throttled = tuple(rule for rule, (bit, _) in THROTTLE_RULES.items() if int(reasons or 0) & bit)
    if throttled:
        return Expectation(throttled, rules.clock_window_s * rules.throttle_duty)
    if "sm_clock_mhz" in fields and not int(reasons or 0) & EXPLAINS_LOW_CLOCK:
        return Expectation((LOW_CLOCK_RULE,), rules.clock_window_s * rules.level_duty)
    if "temp_c" in fields or "mem_temp_c" in fields:
        return Expectation(("thermal_margin_low",), rules.thermal_window_s * rules.level_duty)
    return Expectation()


def _dcgm_expectation(spec: DcgmSpec, config: Config) -> Expectation:
    if spec.field_id == XID_FIELD:
        return xid_expectation(int(spec.value))
    names = {number: name for name, number in DCGM_FIELDS.items()}
    name = names.get(spec.field_id)
    if name in {"ecc_dbe_volatile", "ecc_dbe_aggregate"}:
        return Expectation(("ecc_uncorrectable",))
    return _fields_expectation({name: spec.value} if name else {}, config)


def _parts(text: str, where: str, known: tuple[str, ...]) -> dict[str, str]:
    parts: dict[str, str] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        key, raw = key.strip(), raw.strip()
        if not part.strip():
            raise ConfigError(f"{where}: empty part in {text!r}")
        if not sep or not key or not raw:
            raise ConfigError(f"{where}: {part.strip()!r} is not key=value")
        if key not in known:
            raise ConfigError(f"{where}: {key}={raw}: unknown key (known: {', '.join(sorted(known))})")
        if key in parts:
            raise ConfigError(f"{where}: {key} given twice")
        parts[key] = raw
    return parts


def _value(key: str, raw: str, where: str) -> Any:
    """The typed value of one part, or ConfigError naming it."""
    bad = f"{where}: {key}={raw}"
    if key == "error":
        if raw not in ERROR_KINDS:
            raise ConfigError(f"{bad}: not one of {', '.join(ERROR_KINDS)}")
        return raw
    if key == "event":
        if raw not in EVENT_KINDS:
            raise ConfigError(f"{bad}: not one of {', '.join(EVENT_KINDS)}")
        return raw
    if key == "expect":
        if raw not in ALL_RULE_IDS:
            raise ConfigError(f"{bad}: not a rule id (known: {', '.join(ALL_RULE_IDS)})")
        return raw
    number = _number(raw)
    if number is None:
        raise ConfigError(f"{bad}: not a number")
    if key in {"gpu", "xid", "field"} and not isinstance(number, int):
        raise ConfigError(f"{bad}: not a whole number")
    if key in {"for", "within"} and not 0 < number <= 86400:
        raise ConfigError(f"{bad}: seconds must be in (0, 86400]")
    if key == "gpu" and number < 0:
        raise ConfigError(f"{bad}: not a GPU index")
    if key == "xid" and not 1 <= number <= 1000:
        raise ConfigError(f"{bad}: XIDs are 1 to 1000")
    return number


def _number(raw: str) -> int | float | None:
    try:
        return int(raw, 0)
    except ValueError:
        pass
    try:
        number = float(raw)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _gpu(value: Any, where: str, need_gpu: bool) -> int | None:
    if value is None and need_gpu:
        raise ConfigError(f"{where}: gpu=N is missing")
    if value is not None and not need_gpu:
        raise ConfigError(f"{where}: gpu={value}: the schedule entry's `gpu` names the target")
    return None if value is None else int(value)
