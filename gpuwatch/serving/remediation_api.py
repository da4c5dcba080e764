"""Remediation's part of the HTTP API: GET /v1/incidents, GET /v1/trainers, and the ranks in a GPU's JSON.

Read-only, so no token. Every body is built from remediation's last judgement and the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request

from gpuwatch.health import trainer_rules
from gpuwatch.node.ranks import Rank
from gpuwatch.node.store import Store
from gpuwatch.remediation import Remediation
from gpuwatch.serving import wire
from gpuwatch.serving.viewer import sees, viewer_uid

MAX_INCIDENTS = 1000


def route_set(remediation: Remediation, store: Store) -> Callable[[FastAPI, Callable[..., None]], None]:
    """The routes for create_api: both are read-only, so the token check goes unused."""
    return lambda app, _require_token: add_routes(app, remediation, store)


def add_routes(app: FastAPI, remediation: Remediation, store: Store) -> None:
    """GET /v1/incidents (newest first, `limit` clamped to 1..1000) and GET /v1/trainers."""

    # An incident is shown as stored: the keys of an older version's incident are neither added nor dropped.
    @app.get("/v1/incidents", response_model_exclude_unset=True)
    def incidents(limit: int = 100) -> wire.Incidents:
        stored = store.incidents(limit=max(1, min(limit, MAX_INCIDENTS)))
        return wire.Incidents(incidents=[wire.Incident.model_validate(i) for i in stored])

    @app.get("/v1/trainers")
    def trainers(request: Request) -> wire.Trainers:
        """Every rank and report; another user's without its pid, uid, job and role (gpuwatch.serving.viewer)."""
        viewer = viewer_uid(request.scope)
        ranks, verdict = remediation.ranks()
        return wire.Trainers(
            ranks=[_shown(rank_json(r), viewer) for r in ranks],
            findings=[wire.Finding(**f.as_dict()) for f in verdict.findings],
            reports=[
                _shown(wire.HeldReport(**dataclasses.asdict(r.info), alive=r.alive), viewer)
                for r in remediation.runtime.read_reports()
            ],
        )


_HIDDEN = {"pid": 0, "uid": None, "job_id": None, "spare": None, "recovery": None}
TrainerBody = TypeVar("TrainerBody", bound=wire.Trainer)


def _shown(body: TrainerBody, viewer: int | None) -> TrainerBody:
    """The body as `viewer` may see it: another user's rank has pid 0 and no uid, job or role."""
    return body if sees(viewer, body.uid) else body.model_copy(update=_HIDDEN)


def gpu_view(remediation: Remediation, index: int) -> dict[str, Any]:
    """What GET /v1/gpus/{index} shows of this GPU's ranks (from NVML, environ and reports) and findings."""
    ranks, verdict = remediation.ranks()
    return {
        "ranks": [rank_json(r) for r in ranks if r.gpu == index],
        "trainer_findings": [wire.Finding(**f.as_dict()) for f in verdict.findings if f.index == index],
    }


def rank_json(rank: Rank) -> wire.Rank:
    return wire.Rank(
        **dataclasses.asdict(rank.info),
        gpu=rank.gpu,
        sources=list(rank.sources),
        fragmentation_ratio=trainer_rules.fragmentation_ratio(rank.info),
    )
