"""`gpuwatch service assets --out DIR`: the monitoring assets a fleet's Prometheus, Alertmanager and Grafana load.

They ship in the wheel (share/gpuwatch/monitoring/), so the host that runs Prometheus needs the wheel, not a
checkout. Their runbook links name the runbook in the wheel of a node with the default prefix; the copies
point at the copy of the runbook made beside them, or at `runbook_url` where the runbook is published
(a wiki, an internal git host), so that a link in a page or a dashboard opens something that exists.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuwatch.errors import ServiceError
from gpuwatch.service.layout import MONITORING, MONITORING_FILES, SHARE, SHIPPED_RUNBOOK_URL

LINKING = ("prometheus/gpuwatch-alerts.yml", "grafana/gpuwatch.json")  # the files that link to the runbook


def copy_assets(prefix: Path, out: Path, runbook_url: str | None) -> list[Path]:
    """Copy every monitoring asset from the venv at `prefix` into `out` (kept in its sub-directory), the runbook
    links pointed at `runbook_url` or else at the copy in `out`; the files written.

    Raises:
        ServiceError: the wheel's assets are missing, `out` is not a directory or cannot be written,
            `runbook_url` has no scheme.
    """
    source = prefix / SHARE / MONITORING
    missing = [name for name in MONITORING_FILES if not (source / name).is_file()]
    if missing:
        raise ServiceError(f"{source} lacks {', '.join(missing)}: install the gpuwatch-daemon wheel into {prefix}")
    if runbook_url is not None and "://" not in runbook_url:
        raise ServiceError(f"--runbook-url {runbook_url!r}: give a full URL, e.g. https://wiki.example.com/RUNBOOK.md")
    out = out.absolute()
    if out.exists() and not out.is_dir():
        raise ServiceError(f"--out {out}: not a directory")
    link = runbook_url or f"file://{out / 'RUNBOOK.md'}"
    written = []
    try:
        for name in MONITORING_FILES:
            text = (source / name).read_text(encoding="utf-8")
            if name in LINKING:
                text = text.replace(SHIPPED_RUNBOOK_URL, link)
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            temp = target.with_name(f".{target.name}.new")
            temp.write_text(text, encoding="utf-8")
            os.replace(temp, target)
            written.append(target)
    except OSError as exc:
        raise ServiceError(f"--out {out}: cannot write {exc.filename or out}: {exc.strerror or exc}") from None
    return written
