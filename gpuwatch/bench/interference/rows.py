"""The interference section's part of the bench table: each condition's steps and costs, the targets, the probe.

The targets are the short step's, for gpuwatch @ 1 s as shipped: p50 and mean at most 0.1 % over
alone, the mean's interval below 0.2 %, no more than nvitop-exporter (round by round), and at 30 s an
interval that includes 0. On the sim backend they do not apply (a CPU step, no GPU measured).
"""

from __future__ import annotations

from typing import Any

from gpuwatch.bench.interference import STEPS
from gpuwatch.bench.report import Row, Section, not_applicable, target
from gpuwatch.bench.stats import ALONE

OURS, OURS_30S, NVITOP = "gpuwatch_1s", "gpuwatch_30s", "nvitop_exporter_1s"
COST_TARGET_PCT = 0.1  # gpuwatch at 1 s, short step, p50 and mean
INTERVAL_TARGET_PCT = 0.2  # the mean's interval must exclude this
SIM = "sim: a CPU step, the GPU side not measured"


def add(section: Section, on_gpu: bool) -> None:
    """Rows in the order the run made them: the event-set probe, every step that ran, the bare check."""
    figures = section.figures
    probe = figures.get("event_set")
    if probe is not None:
        for key, entry in probe["conditions"].items():
            section.rows.append(
                Row(f"event-set probe · {entry['label']}: p50 / mean / p99 / max", _steps_text(entry), "ms")
            )
            name = "alone (placebo)" if key == ALONE else entry["label"]
            for stat in ("p50", "mean"):
                if f"{stat}_vs_alone" in entry:
                    label = f"event-set probe · {name}: {stat} vs alone"
                    section.rows.append(Row(label, *_pct(entry[f"{stat}_vs_alone"])))
    for kind in STEPS:
        if kind in figures:
            section.rows.extend(_step_rows(kind, figures[kind], on_gpu))
    bare = figures["bare"]
    if "alone_vs_bare_mean_pct" in bare:
        label = "short step alone vs bare (before anything started, after everything stopped), mean"
        section.rows.append(Row(label, bare["alone_vs_bare_mean_pct"], "%"))


def _step_rows(kind: str, result: dict[str, Any], on_gpu: bool) -> list[Row]:
    step = f"{kind} step"
    found: list[Row] = []
    for key, entry in result["conditions"].items():
        name = "alone (placebo)" if key == ALONE else entry["label"]
        steps = f"{step} ({result['step_ms']:.3g} ms) · {entry['label']}: p50 / mean / p99 / max"
        found.append(Row(steps, _steps_text(entry), "ms"))
        for stat in ("p50", "mean"):
            ratio = entry.get(f"{stat}_vs_alone")
            if ratio is None:
                continue
            label = f"{step} · {name}: {stat} vs alone"
            if kind != "short" or key != OURS:
                found.append(Row(label, *_pct(ratio)))
            elif not on_gpu:
                found.append(not_applicable(label, ratio["pct"], _pct(ratio)[1], SIM))
            else:
                found.append(target(label, ratio["pct"], "%", COST_TARGET_PCT, against=_interval_text(ratio)))
    for name, entry in result.get("differences", {}).items():
        ratio = entry["mean"]
        label = f"{step}: {entry['label']}, mean vs alone, round by round"
        if kind == "short" and name == f"{OURS}-{NVITOP}":  # the target: no more than the peer
            if on_gpu:
                found.append(target(label, ratio["pct"], "%", 0.0, against=_interval_text(ratio)))
            else:
                found.append(not_applicable(label, ratio["pct"], _pct(ratio)[1], SIM))
        else:
            found.append(Row(label, *_pct(ratio)))
    if kind == "short":
        found.extend(_targets(result["conditions"], on_gpu, step))
    return found


def _targets(conditions: dict[str, Any], on_gpu: bool, step: str) -> list[Row]:
    """The interval's top for gpuwatch @ 1 s, and at 30 s an interval that includes 0."""
    found: list[Row] = []
    ours = conditions.get(OURS, {}).get("mean_vs_alone")
    if ours is not None and ours["high_pct"] is not None:
        label = f"{step} · gpuwatch @ 1 s: mean vs alone, the interval's top"
        if on_gpu:
            found.append(target(label, ours["high_pct"], "%", INTERVAL_TARGET_PCT))
        else:
            found.append(not_applicable(label, ours["high_pct"], "%", SIM))
    slow = conditions.get(OURS_30S, {}).get("mean_vs_alone")
    if slow is not None and slow["low_pct"] is not None:
        inside = slow["low_pct"] <= 0.0 <= slow["high_pct"]
        label = f"{step} · gpuwatch @ 30 s: mean vs alone"
        found.append(Row(label, slow["pct"], "%", "interval includes 0", inside if on_gpu else None))
    return found


def _steps_text(entry: dict[str, Any]) -> str:
    return " / ".join(f"{entry[f'{stat}_ms']:.4g}" for stat in ("p50", "mean", "p99", "max"))


def _interval_text(ratio: dict[str, Any]) -> str:
    if ratio["low_pct"] is None:
        return f"{ratio['pairs']} pair, no interval"
    return f"95 % CI {ratio['low_pct']:+.3f} to {ratio['high_pct']:+.3f} %, {ratio['pairs']} pairs"


def _pct(ratio: dict[str, Any]) -> tuple[float, str]:
    """A ratio's value and its unit with the interval, for a Row."""
    return ratio["pct"], f"% ({_interval_text(ratio)})"
