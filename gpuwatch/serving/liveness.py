"""What GET /healthz answers, without the API framework: a probed node stays at a scraped node's memory.

systemd, Kubernetes and load balancers probe /healthz every few seconds on every node; built on
FastAPI, the first probe would load FastAPI, starlette and pydantic (about 16 MiB) into a daemon
that is otherwise only scraped. The body is wire.Healthz's (tests/serving/test_wire.py holds it to that schema).
"""

from __future__ import annotations

import json
from typing import Any

from gpuwatch.model import Snapshot

STALE_INTERVALS = 3  # no sample for this many intervals: the sampling loop is stuck or dead


def healthz(snapshot: Snapshot, now: float, interval_s: float) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 `ok`; 503 `stale` (no recent sample) or `store_degraded` (with why and how much)."""
    age = now - snapshot.t
    stale = snapshot.samples_total == 0 or age > STALE_INTERVALS * interval_s
    status = "stale" if stale else "store_degraded" if snapshot.store_error else "ok"
    body: dict[str, Any] = {"status": status, "last_sample_age_s": round(age, 3), "gpus": len(snapshot.gpus)}
    if snapshot.store_error:
        body["store_error"] = snapshot.store_error
        body["store_unsaved_changes"] = snapshot.store_unsaved
    return (200 if status == "ok" else 503), body


def healthz_json(snapshot: Snapshot, now: float, interval_s: float) -> tuple[int, bytes]:
    code, body = healthz(snapshot, now, interval_s)
    return code, json.dumps(body).encode()
