"""The HTTP API over a sim daemon: reads, token checks, validation, quarantine persistence."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SimNode, start_sim_node


@pytest.fixture
def node(tmp_path: Path) -> SimNode:
    node = start_sim_node(tmp_path, "healthy", gpus=4)
    yield node
    node.close()


def test_gpus_lists_every_gpu_with_state_and_sample(node: SimNode) -> None:
    node.run_for(20)
    body = node.client.get("/v1/gpus").json()
    assert [g["index"] for g in body["gpus"]] == [0, 1, 2, 3]
    for g in body["gpus"]:
        assert g["state"] == "healthy"
        assert g["uuid"].startswith("GPU-")
        assert g["sample"]["sm_clock_mhz"] > 0
        assert g["quarantined"] is False


def test_unknown_gpu_is_404(node: SimNode) -> None:
    assert node.client.get("/v1/gpus/9").status_code == 404
    assert node.client.post("/v1/gpus/9/quarantine", json={"reason": "x"}, headers=node.auth).status_code == 404


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}])
def test_post_without_right_token_is_401_and_changes_nothing(node: SimNode, headers: dict[str, str]) -> None:
    response = node.client.post("/v1/gpus/1/quarantine", json={"reason": "test"}, headers=headers)
    assert response.status_code == 401
    assert node.gpu(1)["quarantined"] is False


@pytest.mark.parametrize("body", [{}, {"reason": ""}, {"reason": "x", "extra": 1}, {"reason": 5}, [1, 2]])
def test_invalid_body_is_422_and_changes_nothing(node: SimNode, body: object) -> None:
    response = node.client.post("/v1/gpus/1/quarantine", json=body, headers=node.auth)
    assert response.status_code == 422
    assert node.gpu(1)["quarantined"] is False


def test_quarantine_release_roundtrip_bumps_epoch_and_writes_status_json(node: SimNode, tmp_path: Path) -> None:
    response = node.client.post("/v1/gpus/2/quarantine", json={"reason": "operator test"}, headers=node.auth)
    assert response.status_code == 200
    gpu = node.gpu(2)
    assert gpu["quarantined"] is True and gpu["quarantine_reason"] == "operator test" and gpu["epoch"] == 1
    status = (tmp_path / "run" / "status.json").read_text()
    assert '"quarantined":true' in status
    node.run_for(3600)
    assert node.gpu(2)["quarantined"] is True, "an operator quarantine is never burned in"
    assert node.client.post("/v1/gpus/2/release", json={}, headers=node.auth).status_code == 200
    assert node.gpu(2)["quarantined"] is False


@pytest.mark.slow
def test_quarantine_survives_restart(tmp_path: Path) -> None:
    first = start_sim_node(tmp_path, "healthy", gpus=4)
    first.client.post("/v1/gpus/3/quarantine", json={"reason": "bad fan"}, headers=first.auth)
    first.close()
    second = start_sim_node(tmp_path, "healthy", gpus=4)
    try:
        gpu = second.gpu(3)
        assert gpu["quarantined"] is True and gpu["quarantine_reason"] == "bad fan" and gpu["epoch"] == 1
        assert second.gpu(2)["quarantined"] is False
    finally:
        second.close()


def test_token_file_is_private(node: SimNode, tmp_path: Path) -> None:
    token = tmp_path / "state" / "token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert token.read_text().strip() == node.daemon.token


def test_inject_validates_and_marks_drill(node: SimNode) -> None:
    bad = node.client.post("/v1/gpus/1/inject", json={"fields": {"no_such": 1}}, headers=node.auth)
    assert bad.status_code == 422
    assert node.client.post("/v1/gpus/1/inject", json={}, headers=node.auth).status_code == 422
    ok = node.client.post(
        "/v1/gpus/1/inject", json={"fields": {"remapped_pending": 1}, "duration_s": 60}, headers=node.auth
    )
    assert ok.status_code == 200, ok.text
    node.run_for(10)
    gpu = node.gpu(1)
    assert gpu["state"] == "unhealthy"
    assert [f["rule"] for f in gpu["findings"]] == ["row_remap_pending"]
    assert gpu["findings"][0]["drill"] is True
    assert node.gpu(0)["findings"] == []


def test_healthz_and_status_page(node: SimNode) -> None:
    assert node.client.get("/healthz").json()["status"] == "ok"
    page = node.client.get("/")
    assert page.status_code == 200 and "<table>" in page.text and 'http-equiv="refresh"' in page.text


def test_healthz_says_stale_once_sampling_stops_and_answers_only_get_and_head(node: SimNode) -> None:
    interval = node.daemon.config.interval_s
    node.clock.t += 3 * interval  # three intervals without a sample: still within the limit
    assert node.client.get("/healthz").status_code == 200
    node.clock.t += 0.5
    stale = node.client.get("/healthz")
    assert (stale.status_code, stale.json()["status"], stale.headers["content-type"]) == (
        503,
        "stale",
        "application/json",
    )
    assert stale.json()["last_sample_age_s"] == 3 * interval + 0.5
    assert node.client.head("/healthz").content == b""
    assert node.client.post("/healthz").status_code == 405


def test_an_empty_token_file_is_replaced(tmp_path: Path) -> None:
    from gpuwatch.serving.api_token import ensure_token

    path = tmp_path / "token"
    path.write_text("\n")
    token = ensure_token(path)
    assert len(token) >= 32 and path.read_text().strip() == token
    assert path.stat().st_mode & 0o777 == 0o600


def test_release_of_an_unhealthy_gpu_needs_force_and_names_its_findings(node: SimNode) -> None:
    inject = node.client.post("/v1/gpus/1/inject", json={"event": "xid", "xid": 79}, headers=node.auth)
    assert inject.status_code == 200
    assert node.gpu(1)["quarantined"] is True and node.gpu(1)["state"] == "unhealthy"
    refused = node.client.post("/v1/gpus/1/release", json={"reason": "looks fine"}, headers=node.auth)
    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert detail.startswith("GPU 1 is still unhealthy: xid_critical (unhealthy): ") and "--force" in detail
    assert node.gpu(1)["quarantined"] is True, "a refused release changes nothing"
    forced = node.client.post("/v1/gpus/1/release", json={"reason": "swapped", "force": True}, headers=node.auth)
    assert forced.status_code == 200
    assert (forced.json()["changed"], forced.json()["message"]) == (True, "GPU 1 released; state unhealthy")
    assert node.gpu(1)["quarantined"] is False


def test_release_of_a_gpu_not_quarantined_says_nothing_changed(node: SimNode) -> None:
    body = node.client.post("/v1/gpus/2/release", json={}, headers=node.auth).json()
    assert (body["changed"], body["message"]) == (False, "GPU 2 was not quarantined: nothing changed")


def test_a_second_quarantine_says_what_it_did(node: SimNode) -> None:
    first = node.client.post("/v1/gpus/2/quarantine", json={"reason": "fan noise"}, headers=node.auth).json()
    assert (first["changed"], first["message"]) == (True, "GPU 2 quarantined (epoch 1): fan noise")
    second = node.client.post("/v1/gpus/2/quarantine", json={"reason": "still noisy"}, headers=node.auth).json()
    assert second["changed"] is False and second["quarantine_reason"] == "fan noise" and second["epoch"] == 1
    assert second["message"] == (
        "GPU 2 was already quarantined by an operator: nothing changed; the reason stays 'fan noise' (release it first)"
    )


def test_an_operator_quarantine_takes_over_an_automatic_one_and_says_so(node: SimNode) -> None:
    node.client.post("/v1/gpus/3/inject", json={"event": "xid", "xid": 79}, headers=node.auth)
    automatic = node.gpu(3)["quarantine_reason"]
    body = node.client.post("/v1/gpus/3/quarantine", json={"reason": "RMA"}, headers=node.auth).json()
    assert body["changed"] is True and body["quarantine_reason"] == "RMA"
    assert body["message"] == f"GPU 3 was quarantined automatically ({automatic}); now held by the operator: RMA"
