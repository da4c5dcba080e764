"""The status page at GET /: one server-rendered HTML table of the node, refreshing itself.

No front-end build and no JavaScript: what an operator opens at 3 a.m. must work from a
plain `ssh -L` tunnel in any browser.
"""

from __future__ import annotations

from html import escape

from gpuwatch import __version__
from gpuwatch.model import GpuStatus, Snapshot

REFRESH_S = 5

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d232b;background:#f7f8fa}
h1{font-size:1.3rem;margin:0 0 .2rem}.meta{color:#5b6573;margin-bottom:1rem}
table{border-collapse:collapse;width:100%;background:#fff;box-shadow:0 1px 2px #0002}
th,td{padding:.45rem .6rem;border-bottom:1px solid #e3e6ea;text-align:left;vertical-align:top;font-size:.9rem}
th{background:#eef1f4}.state{font-weight:600;border-radius:3px;padding:.1rem .4rem;color:#fff}
.healthy{background:#2e7d32}.degraded{background:#b26a00}.unhealthy{background:#c62828}.unknown{background:#6b7280}
.q{color:#c62828;font-weight:600}.node{margin:0 0 1rem}
.drill{background:#6a1b9a;color:#fff;border-radius:3px;padding:0 .3rem;font-size:.75rem}
ul{margin:0;padding-left:1rem}.mono{font-family:ui-monospace,monospace;font-size:.8rem}
"""


def _findings(g: GpuStatus) -> str:
    if not g.findings:
        return "—"
    items = "".join(
        f"<li><b>{escape(f.rule)}</b> ({escape(f.severity.value)}): {escape(f.reason)}"
        + (' <span class="drill">drill</span>' if f.drill else "")
        + "</li>"
        for f in g.findings
    )
    return f"<ul>{items}</ul>"


def _trainers(g: GpuStatus) -> str:
    if not g.trainers:
        return "—"
    return "<br>".join(
        escape(f"rank {t.rank} (pid {t.pid}" + (f", job {t.job_id}" if t.job_id else "") + ")")
        + (escape(f", step {t.step}") if t.step is not None else "")
        for t in g.trainers
    )


def _row(g: GpuStatus, now: float) -> str:
    age = f"{now - g.sample.t:.0f} s" if g.sample else "never"
    if g.error is not None:
        age += f" (read error: {escape(g.error.kind)})"
    quarantined = (
        f'<span class="q">yes</span><br><small>{escape(g.quarantine_reason)}</small>' if g.quarantined else "no"
    )
    return (
        f'<tr data-gpu="{g.index}" data-state="{g.state.value}"><td>{g.index}</td>'
        f'<td class="mono">{escape(g.uuid)}<br>{escape(g.static.name)}</td>'
        f'<td><span class="state {g.state.value}">{g.state.value}</span></td>'
        f"<td>{_findings(g)}</td><td>{escape(g.suggested_action.value)}</td><td>{quarantined}</td>"
        f"<td>{_trainers(g)}</td><td>{age}</td></tr>"
    )


def _node_findings(snapshot: Snapshot) -> str:
    """The findings on the node itself (a GPU missing), above the table: no row of it can show them."""
    return "".join(
        f'<p class="node" data-rule="{escape(f.rule)}"><span class="state {f.severity.value}">{escape(f.rule)}</span> '
        f"{escape(f.reason)}</p>"
        for f in snapshot.node_findings
    )


def render(snapshot: Snapshot, now: float, node: str) -> str:
    bad = sum(1 for g in snapshot.gpus if g.state.value in {"degraded", "unhealthy"})
    quarantined = sum(1 for g in snapshot.gpus if g.quarantined)
    rows = "".join(_row(g, now) for g in snapshot.gpus)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>gpuwatch: {escape(node)}</title><style>{_CSS}</style></head>
<body><h1>gpuwatch on {escape(node)}</h1>
<div class="meta">{len(snapshot.gpus)} GPUs · {bad} degraded or unhealthy · {quarantined} quarantined ·
backend {escape(snapshot.backend)} · last judged {now - snapshot.t:.0f} s ago · gpuwatch {__version__} ·
refreshes every {REFRESH_S} s · <a href="/metrics">metrics</a> · <a href="/v1/gpus">JSON</a></div>
{_node_findings(snapshot)}
<table><thead><tr><th>GPU</th><th>UUID / model</th><th>state</th><th>reasons</th><th>suggested action</th>
<th>quarantined</th><th>trainer ranks</th><th>last sample</th></tr></thead><tbody>{rows}</tbody></table>
</body></html>"""
