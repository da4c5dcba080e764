"""What `gpuwatch status` prints: a table that fits the terminal, the full table, or one GPU per line in full.

The table must fit an 80-column terminal: a GPU's findings can run to hundreds of characters, and an
automatic quarantine's reason repeats them. So the fitted table shows each finding's rule and as much of
its reason as fits, the quarantine's reason only when it says something the findings do not (an
operator's), and leaves out the columns an operator needs least when even that does not fit.
`--plain` and `--wide` show everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from gpuwatch.serving.wire import Finding, Gpu

STATE_STYLE = {"healthy": "green", "degraded": "yellow", "unhealthy": "bold red", "unknown": "dim"}
FULL_COLUMNS = ("GPU", "UUID", "state", "quarantined", "SM MHz", "W", "°C", "findings", "action", "ranks")
# The fitted table's columns in order; `reasons` takes the width left.
FITTED_COLUMNS = ("GPU", "UUID", "state", "quar.", "SM MHz", "W", "°C", "action", "ranks", "reasons")
DROP_FIRST = ("UUID", "ranks", "W", "°C", "SM MHz", "action")  # left out in this order until the table fits
MIN_REASONS = 24  # narrower than this, a finding's rule id no longer shows whole: leave out a column instead
GAP = 2  # the space between two columns
SHORT_UUID = 12  # "GPU-a8bb315b": enough to tell the GPUs of a node apart


def full_row(g: Gpu) -> list[str]:
    """One GPU's cells, in FULL_COLUMNS order, every value whole."""
    sample = g.sample
    return [
        str(g.index),
        g.uuid,
        g.state,
        "yes: " + (g.quarantine_reason or "") if g.quarantined else "no",
        _fmt(sample.sm_clock_mhz if sample else None),
        _fmt(sample.power_w if sample else None, "{:.0f}"),
        _fmt(sample.temp_c if sample else None),
        "; ".join(f"{f.rule}: {f.reason}" for f in g.findings) or "-",
        g.suggested_action,
        _ranks(g, lambda t: f"rank {t.rank} (pid {t.pid})") or "-",
    ]


def plain_lines(gpus: Sequence[Gpu]) -> list[str]:
    """One GPU per line, `column: value`, in full: for pipes and for terminals too narrow for any table."""
    lines = []
    for g in gpus:
        row = full_row(g)
        labelled = [f"{column}: {value}" for column, value in zip(FULL_COLUMNS[1:], row[1:], strict=True)]
        lines.append("GPU " + ", ".join([row[0], *labelled]))
    return lines


def wide_table(gpus: Sequence[Gpu]) -> Table:
    """Every column, every value whole, as wide as that takes (`--wide`)."""
    table = Table(title="gpuwatch")
    for column in FULL_COLUMNS:
        table.add_column(column, overflow="fold")
    for g in gpus:
        table.add_row(*_styled(full_row(g)))
    return table


def fitted_table(gpus: Sequence[Gpu], width: int) -> Table | None:
    """The table in at most `width` columns, or None when not even GPU, state and reasons fit."""
    rows = [_fitted_row(g) for g in gpus]
    columns = list(FITTED_COLUMNS)
    for dropped in (None, *DROP_FIRST):
        if dropped is not None:
            columns.remove(dropped)
        kept = [FITTED_COLUMNS.index(c) for c in columns]
        fixed = {c: max(len(c), *(len(row[i]) for row in rows)) for c, i in zip(columns, kept, strict=True)}
        fixed.pop("reasons")
        left = width - sum(fixed.values()) - GAP * (len(columns) - 1)
        if left >= MIN_REASONS:
            break
    else:
        return None
    natural = max(len("reasons"), *(len(row[-1]) for row in rows))
    table = Table(box=None, padding=(0, GAP // 2), pad_edge=False, show_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column, width=fixed.get(column, min(left, natural)), no_wrap=True, overflow="ellipsis")
    for row in rows:
        table.add_row(*_styled([row[FITTED_COLUMNS.index(c)] for c in columns], state_at=columns.index("state")))
    return table


def node_lines(findings: Sequence[Finding]) -> list[str]:
    """The findings on the node itself (a GPU missing): no row of the table can hold them."""
    return [f"node {f.severity}: {f.rule}: {f.reason}" for f in findings]


def _fitted_row(g: Gpu) -> list[str]:
    sample = g.sample
    reasons = "; ".join(f"{f.rule}: {f.reason}" for f in g.findings)
    said = {f.rule for f in g.findings}
    reason = g.quarantine_reason or ""
    if g.quarantined and reason and not any(rule in reason for rule in said):  # an automatic one repeats them
        reasons = "; ".join(filter(None, [reasons, f"quarantined: {reason}"]))
    return [
        str(g.index),
        g.uuid[:SHORT_UUID],
        g.state,
        "yes" if g.quarantined else "no",
        _fmt(sample.sm_clock_mhz if sample else None),
        _fmt(sample.power_w if sample else None, "{:.0f}"),
        _fmt(sample.temp_c if sample else None),
        g.suggested_action,
        _ranks(g, lambda t: str(t.rank)) or "-",
        reasons or "-",
    ]


def _ranks(g: Gpu, show: Any) -> str:
    return ", ".join(show(t) for t in (g.trainers if g.ranks is None else g.ranks))


def _styled(cells: list[str], state_at: int = 2) -> list[str]:
    """Cells as rich markup: anyone's text escaped (a reason is never markup), the state in its colour."""
    marked = [escape(cell) for cell in cells]
    marked[state_at] = f"[{STATE_STYLE.get(cells[state_at], '')}]{marked[state_at]}[/]"
    return marked


def _fmt(value: Any, pattern: str = "{}") -> str:
    return "-" if value is None else pattern.format(value)
