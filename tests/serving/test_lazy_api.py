"""A node that is only scraped and probed never loads the API framework; the first API request builds it.

Run in a fresh interpreter: this test process has long imported FastAPI for its TestClients.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = r"""
import asyncio, json, sys
from pathlib import Path
from gpuwatch.config import load
from gpuwatch.daemon import Daemon

def call(app, path):
    sent = []
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}
    async def send(message):
        sent.append(message)
    scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"host", b"127.0.0.1:9835")], "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body

root = Path(sys.argv[1])
(root / "none.toml").write_text("")
overrides = {"backend": "sim", "sim.gpus": 2, "state_dir": str(root / "state"), "runtime_dir": str(root / "run")}
daemon = Daemon(load(root / "none.toml", environ={}, overrides=overrides))
daemon.monitor.tick()
app = daemon.app()
status, body = call(app, "/metrics")
after_scrape = sorted(m for m in ("fastapi", "starlette", "pydantic") if m in sys.modules)
health, health_body = call(app, "/healthz")
health_fields = {k: v for k, v in json.loads(health_body).items() if k != "last_sample_age_s"}
after_probe = sorted(m for m in ("fastapi", "starlette", "pydantic") if m in sys.modules)
gpus, gpus_body = call(app, "/v1/gpus")
print(json.dumps({
    "metrics": status, "has_gpus_metric": b"gpuwatch_gpus 2.0" in body, "after_scrape": after_scrape,
    "healthz": health, "health": health_fields, "after_probe": after_probe,
    "gpus": [g["index"] for g in json.loads(gpus_body)["gpus"]],
    "after_api": "fastapi" in sys.modules,
}))
daemon.stop()
"""


@pytest.mark.slow
def test_scrapes_and_probes_leave_fastapi_unloaded_and_the_first_api_call_builds_it(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "metrics": 200,
        "has_gpus_metric": True,
        "after_scrape": [],
        "healthz": 200,
        "health": {"status": "ok", "gpus": 2},
        "after_probe": [],
        "gpus": [0, 1],
        "after_api": True,
    }


def test_gpuwatch_runs_imports_leave_the_terminal_renderer_unloaded() -> None:
    """rich draws tables for `status`, `drill` and `bench`: about 1.6 MiB and 40 modules `gpuwatch run` never uses."""
    probe = (
        "import sys, gpuwatch.cli, gpuwatch.daemon; print(sorted(m for m in sys.modules if m.split('.')[0] == 'rich'))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
