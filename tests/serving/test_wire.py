"""The API's models (gpuwatch.serving.wire) against real answers: what a client parses and writes back is what the
daemon sent.

Every body of a sim daemon with drills, a job's ranks and an incident goes through the model its
route declares; written back, it must be the same JSON to the key, the null and the int-or-float.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from gpuwatch.config import DrillSchedule
from gpuwatch.errors import DaemonError
from gpuwatch.model import SAMPLE_FIELDS, Action, Finding, GpuEvent, Severity, TrainerInfo
from gpuwatch.node.injection import Injection
from gpuwatch.serving import wire
from tests.drills.conftest import Job, start_drill_node
from tests.drills.test_validate_drill import idle_gpu, use_fake_test
from tests.helpers import SimNode

REPO = Path(__file__).resolve().parents[2]
VERDICT = {
    "drill": "inject", "gpu": 3, "uuid": "GPU-x", "spec": "preset=xid79", "trigger": "cli", "started": 1.0,
    "finished": 2.5, "steps": [{"name": "inject", "result": "pass", "duration_s": 0.5, "detail": "ok"}],
    "result": "pass", "broke_at": None,
}  # fmt: skip


@pytest.fixture
def busy(tmp_path: Path) -> Iterator[SimNode]:
    """A sim node with a drill schedule, three ranks of a job (one with allocator figures), a stored verdict."""
    schedule = (DrillSchedule(cron="0 3 * * *", drill="inject", gpu="idle", args="preset=xid79"),)
    node = start_drill_node(tmp_path, gpus=4, schedule=schedule, **{"api.docs": True})
    job = Job(node)
    job.rank(0, 0)
    job.rank(0, 1, reserved_bytes=100, allocated_bytes=60)
    job.rank(1, 2)
    node.run_for(10)
    node.client.post("/v1/drills", json=VERDICT, headers=node.auth)
    yield node
    job.stop()
    node.close()


def same_json(body: Any, model: type[BaseModel]) -> None:
    """`body` parsed into `model` and written back is `body`: keys, their order, nulls, ints and floats."""
    assert json.dumps(model.model_validate(body).model_dump(mode="json")) == json.dumps(body)


def answer(response: Any, model: type[BaseModel], status: int = 200) -> None:
    assert response.status_code == status, response.text
    same_json(response.json(), model)


def test_every_answer_reads_back_as_sent(busy: SimNode) -> None:
    client, auth = busy.client, busy.auth
    gets = {
        "/v1/gpus": wire.GpuList,
        "/v1/gpus/0": wire.Gpu,
        "/v1/findings": wire.Findings,
        "/v1/trainers": wire.Trainers,
        "/v1/drills": wire.Drills,
        "/v1/injections": wire.Injections,
        "/healthz": wire.Healthz,
    }
    for path, model in gets.items():
        answer(client.get(path), model)
    gpu = client.get("/v1/gpus/0").json()
    assert gpu["trainers"] and gpu["ranks"] and any("fragmentation_ratio" in r for r in gpu["ranks"])
    assert all(v is not None for t in gpu["trainers"] + gpu["ranks"] for v in t.values()), "unknowns are left out"
    assert "store_error" not in client.get("/healthz").json()
    assert client.get("/v1/drills").json()["runs"] and client.get("/v1/drills").json()["schedule"]

    answer(
        client.post("/v1/gpus/2/inject", json={"fields": {"temp_c": 99, "power_w": 300}}, headers=auth), wire.Injection
    )
    answer(client.post("/v1/gpus/2/inject", json={"event": "xid", "xid": 79}, headers=auth), wire.Injection)
    answer(client.get("/v1/injections"), wire.Injections)
    quarantined = client.post("/v1/gpus/0/quarantine", json={"reason": "test"}, headers=auth)
    answer(quarantined, wire.GpuChanged)
    assert "ranks" not in quarantined.json() and "validation" not in quarantined.json()
    answer(client.post("/v1/gpus/0/quarantine", json={"reason": "test"}, headers=auth), wire.GpuChanged)
    answer(client.post("/v1/drills/window", json={"gpu": 3, "duration_s": 60}, headers=auth), wire.DrillWindow)
    answer(client.post("/v1/backend/release", json={}, headers=auth), wire.BackendReleased)
    answer(client.post("/v1/backend/reacquire", json={}, headers=auth), wire.BackendReacquired)
    answer(client.post("/v1/drills", json=VERDICT, headers=auth), wire.VerdictStored)
    busy.run_for(60)
    answer(client.get("/v1/incidents"), wire.Incidents)
    assert client.get("/v1/incidents").json()["incidents"][0]["ranks"], "the quarantine stopped the job's ranks"
    answer(client.get("/v1/findings"), wire.Findings)
    assert client.get("/v1/findings").json()["history"]
    answer(client.post("/v1/gpus/0/release", json={"reason": "done"}, headers=auth), wire.GpuChanged)

    idle = idle_gpu(busy, 3)
    use_fake_test(busy, "--tflops 640")
    released = client.post(f"/v1/gpus/{idle}/release", json={"reason": "v", "validate": True}, headers=auth)
    answer(released, wire.GpuChanged)
    assert released.json()["validation"]["outcome"]


def test_every_error_reads_back_as_sent(busy: SimNode) -> None:
    client, auth = busy.client, busy.auth
    answer(client.get("/v1/gpus/42"), wire.ErrorBody, 404)
    answer(client.post("/v1/gpus/0/quarantine", json={"reason": "x"}), wire.ErrorBody, 401)
    answer(client.post("/v1/gpus/0/quarantine", json={"reason": "a\nb"}, headers=auth), wire.UnprocessableBody, 422)
    answer(client.post("/v1/gpus/2/inject", json={}, headers=auth), wire.UnprocessableBody, 422)
    client.post("/v1/gpus/2/inject", json={"event": "xid", "xid": 79}, headers=auth)
    client.post("/v1/gpus/2/quarantine", json={"reason": "hold"}, headers=auth)
    busy.run_for(5)
    answer(client.post("/v1/gpus/2/release", json={"reason": "r"}, headers=auth), wire.ErrorBody, 409)


def test_a_stored_incident_or_run_passes_through_as_stored(busy: SimNode) -> None:
    """An older (or newer) daemon's stored body: no key is added, none is dropped."""
    store = busy.daemon.store
    assert store is not None
    store.add_incident(5.0, {"kind": "quarantine", "gpu": 1, "an_old_key": [1], "ranks": [{"pid": 7}]})
    store.add_drill_run(6.0, "inject", "pass", {"gpu": 1, "steps": [], "a_new_key": "x"})
    incidents = busy.client.get("/v1/incidents").json()["incidents"]
    assert incidents[0] == {"id": incidents[0]["id"], "t": 5.0, "kind": "quarantine", "gpu": 1, "an_old_key": [1],
                            "ranks": [{"pid": 7}]}  # fmt: skip
    run = busy.client.get("/v1/drills").json()["runs"][0]
    assert run == {"t": 6.0, "drill": "inject", "result": "pass", "gpu": 1, "steps": [], "a_new_key": "x"}


def test_the_openapi_schema_names_every_answer(busy: SimNode) -> None:
    schema = busy.client.get("/openapi.json").json()
    for path, methods in schema["paths"].items():
        for method, operation in methods.items():
            ok = next(code for code in operation["responses"] if code.startswith("2"))
            if path != "/":  # the status page
                assert "$ref" in operation["responses"][ok]["content"]["application/json"]["schema"], f"{method} {path}"
    gpu = schema["components"]["schemas"]["Gpu"]
    assert "quarantine_reason" in gpu["required"] and "ranks" not in gpu["required"]


def test_the_models_mirror_the_daemons_own_records() -> None:
    """A field added to a sample, a trainer, a finding or an injection must be added to its model too."""
    assert list(wire.Sample.model_fields) == [f for f in SAMPLE_FIELDS if f not in {"index", "uuid"}]
    assert list(wire.Trainer.model_fields) == [f.name for f in dataclasses.fields(TrainerInfo)]
    finding = Finding("ecc_dbe", Severity.UNHEALTHY, "1 DBE", Action.RESET_GPU, 5.0, 2, "GPU-2", drill=True)
    assert wire.Finding(**finding.as_dict()).model_dump() == finding.as_dict()
    event = GpuEvent(5.0, 2, "GPU-2", "xid", xid=79, drill=True)
    injection = Injection(3, 2, {"temp_c": 99, "power_w": 300.0, "pids": [1]}, 5.0, 65.0, event)
    assert json.dumps(wire.Injection(**injection.as_dict()).model_dump(mode="json")) == json.dumps(injection.as_dict())


def test_an_answer_that_is_not_the_body_is_a_daemon_error() -> None:
    with pytest.raises(DaemonError, match=r"GET /v1/gpus: the daemon's answer is not a GpuList \(t: Field required\)"):
        wire.read(wire.GpuList, {"gpus": []}, "GET /v1/gpus")
    with pytest.raises(DaemonError, match="the daemon's answer is not a Gpu"):
        wire.read(wire.Gpu, ["not", "an", "object"], "GET /v1/gpus/0")


def test_the_cli_and_the_daemon_start_without_pydantic() -> None:
    """The models load with the first answer read: `gpuwatch --help` and a scraped-only daemon never pay for them."""
    code = (
        "import sys, gpuwatch.cli, gpuwatch.daemon; "
        "print(sorted({'pydantic', 'gpuwatch.serving.wire'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
