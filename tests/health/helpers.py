"""Build samples and histories for rule tests: a healthy busy H200 by default, any field overridden."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from gpuwatch.config import RulesConfig
from gpuwatch.health import engine
from gpuwatch.health.history import History
from gpuwatch.model import Finding, GpuError, GpuEvent, GpuSample, GpuStatic, Health

T0 = 1_800_000_000.0
UUID = "GPU-00000000-0000-0000-0000-000000000000"
H200 = GpuStatic(
    index=0,
    uuid=UUID,
    name="NVIDIA H200",
    max_sm_clock_mhz=1980,
    max_mem_clock_mhz=3201,
    power_limit_w=700.0,
    slowdown_temp_c=89,
    shutdown_temp_c=95,
    mem_max_temp_c=95,
    gpu_max_temp_c=87,
)
# A healthy H200 under full matmul load, as measured (DESIGN.md): capped at 1455 MHz, reason 0x4.
BUSY: dict[str, Any] = {
    "sm_clock_mhz": 1455,
    "mem_clock_mhz": 3201,
    "power_w": 690.0,
    "temp_c": 57,
    "mem_temp_c": 50,
    "util_gpu_pct": 100,
    "util_mem_pct": 35,
    "clocks_event_reasons": 0x4,
    "pstate": 0,
    "ecc_sbe_volatile": 0,
    "ecc_dbe_volatile": 0,
    "ecc_sbe_aggregate": 0,
    "ecc_dbe_aggregate": 0,
    "remapped_cor": 0,
    "remapped_unc": 0,
    "remapped_pending": 0,
    "remapped_failure": 0,
}
IDLE: dict[str, Any] = {**BUSY, "sm_clock_mhz": 345, "power_w": 82.0, "util_gpu_pct": 0, "clocks_event_reasons": 0x1}

Fields = dict[str, Any]


def sample(t: float, **fields: Any) -> GpuSample:
    """A busy healthy sample at T0 + t, with `fields` overridden."""
    return GpuSample(t=T0 + t, index=0, uuid=UUID, **{**BUSY, **fields})


def series(duration_s: float, interval_s: float, fields: Callable[[float], Fields] | Fields = BUSY) -> list[GpuSample]:
    """Samples every `interval_s` over [0, duration_s]; `fields` is fixed or a function of t (seconds from T0)."""
    count = int(duration_s // interval_s) + 1
    times = [i * interval_s for i in range(count)]
    return [sample(t, **(fields(t) if callable(fields) else fields)) for t in times]


def history(
    samples: Sequence[GpuSample],
    *,
    now: float | None = None,
    events: Iterable[GpuEvent] = (),
    errors: Iterable[GpuError] = (),
    static: GpuStatic = H200,
    baseline: GpuSample | None = None,
) -> History:
    """A History at `now` (seconds from T0; default the last sample) with the first sample as baseline."""
    at = T0 + now if now is not None else (samples[-1].t if samples else T0)
    return History(
        static=static,
        now=at,
        samples=tuple(samples),
        events=tuple(events),
        errors=tuple(errors),
        baseline=baseline or (samples[0] if samples else None),
    )


def event(t: float, kind: str = "xid", xid: int | None = None, drill: bool = False) -> GpuEvent:
    return GpuEvent(t=T0 + t, index=0, uuid=UUID, kind=kind, xid=xid, drill=drill)


def error(t: float, kind: str) -> GpuError:
    return GpuError(t=T0 + t, index=0, uuid=UUID, kind=kind)


def rolling(samples: Sequence[GpuSample], cfg: RulesConfig, static: GpuStatic = H200) -> Iterator[History]:
    """The History the monitor would hold at each sample: the longest window plus slack, first sample as baseline."""
    keep_s = engine.max_window_s(cfg) + 60.0
    for i, last in enumerate(samples):
        kept = tuple(s for s in samples[: i + 1] if s.t >= last.t - keep_s)
        yield History(static=static, now=last.t, samples=kept, baseline=samples[0])


def rules(findings: Iterable[Finding]) -> set[str]:
    return {f.rule for f in findings}


def bad(findings: Iterable[Finding]) -> list[Finding]:
    """Findings that make a GPU degraded or worse."""
    return [f for f in findings if f.severity.health in (Health.DEGRADED, Health.UNHEALTHY)]
