"""`import gpuwatch.trainer` stays light: no daemon dependencies, no torch until a trainer uses it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("fastapi", "pynvml", "apscheduler", "prometheus_client", "gpuwatch.config", "torch")


def test_import_pulls_in_no_daemon_dependency() -> None:
    code = "import json, sys, gpuwatch.trainer, gpuwatch.examples.trainer; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)

    modules = set(json.loads(out.stdout))
    assert "gpuwatch.trainer.link" in modules
    loaded = sorted(m for m in modules if m.split(".")[0] in FORBIDDEN or m in FORBIDDEN)
    assert loaded == []
