"""What a measurement returns, and how the bench prints it (a rich table) and saves it (JSON).

Targets are informational: a miss is shown next to its figure and never changes the exit code.
Figures go to the JSON with their unit in the key (`p99_ms`); rows are the same figures for people.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# The peers' figures measured on an H200 (docs/performance.md §Peers on the same H200): the bench compares
# with them when it cannot run the peer itself, and says so next to the figure.
REFERENCE = {
    "nvml_floor_us": 59.0,
    "nvitop_p99_ms_10_clients": 42.0,
    "nvitop_cpu_core_pct": 0.55,
    "nvitop_rss_mb": 63.0,
    "nvidia_smi_call_ms": 26.0,
}
REFERENCE_SOURCE = "docs/performance.md, H200"


class Skip(Exception):
    """A measurement that cannot run here for a known reason (a missing tool, too few GPUs): not an error."""


@dataclass(frozen=True)
class Row:
    """One figure for the table; `target` and `passed` only where the issue sets a target for it."""

    label: str
    value: float | str | None
    unit: str = ""
    target: str = ""
    passed: bool | None = None
    against: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "figure": self.label,
            "value": self.value,
            "unit": self.unit,
            "target": self.target,
            "pass": self.passed,
            "against": self.against,
        }


@dataclass
class Section:
    """One measurement's result: `status` is ok, skipped (reason says why) or error (it could not run)."""

    name: str
    status: str = "ok"
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status}
        if self.reason:
            body["reason"] = self.reason
        body["figures"] = self.figures
        body["targets"] = [row.as_dict() for row in self.rows if row.target]
        if self.notes:
            body["notes"] = self.notes
        return body


def target(label: str, value: float | None, unit: str, limit: float, *, at_most: bool = True, against: str = "") -> Row:
    """A row with its target: `value` ≤ `limit` (or ≥ with at_most=False); no verdict without a value."""
    text = f"{'≤' if at_most else '≥'} {fmt(limit)} {unit}".rstrip()
    passed = None if value is None else (value <= limit if at_most else value >= limit)
    return Row(label, value, unit, text, passed, against)


def not_applicable(label: str, value: float | None, unit: str, why: str) -> Row:
    """A row whose target does not apply here (e.g. the NVML floor on the sim backend), saying why."""
    return Row(label, value, unit, f"n/a: {why}", None)


def fmt(value: float | str | None) -> str:
    """Three significant figures without switching to exponents for large numbers."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    magnitude = abs(value)
    if magnitude >= 100 or value == int(value):
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def print_table(header: dict[str, Any], sections: list[Section], console: Console) -> None:
    """The figures as one table, each next to its target and a pass/miss verdict."""
    machine = header["machine"]
    title = (
        f"gpuwatch bench {header['mode']} · backend {header['backend']} · {header['gpus']} GPU(s) "
        f"{', '.join(sorted(set(machine['gpu_names'])))} · {machine['hostname']} ({machine['cpu_count']} CPUs)"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("section")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target")
    table.add_column("result")
    for section in sections:
        if section.status != "ok":
            style = "yellow" if section.status == "skipped" else "bold red"
            table.add_row(section.name, f"[{style}]{section.status}[/]: {section.reason}", "", "", "")
        for i, row in enumerate(section.rows):
            value = f"{fmt(row.value)} {row.unit}".rstrip() if row.value is not None else "-"
            table.add_row(
                section.name if i == 0 and section.status == "ok" else "",
                row.label,
                value,
                row.target + (f" ({row.against})" if row.against else ""),
                _verdict(row),
            )
        table.add_section()
    console.print(table)
    for section in sections:
        for note in section.notes:
            console.print(f"[dim]{section.name}: {note}[/]")


def _verdict(row: Row) -> str:
    if row.passed is None:
        return "[dim]n/a[/]" if row.target else ""
    return "[green]pass[/]" if row.passed else "[red]miss[/]"


def write_json(path: Path, header: dict[str, Any], sections: list[Section]) -> None:
    body = {**header, "sections": {s.name: s.as_dict() for s in sections}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2, allow_nan=False) + "\n", encoding="utf-8")
