"""What the framework tests in one process share: a TrainerLink of this process, its signals put back after."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.trainer.link import TrainerLink


@pytest.fixture
def link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TrainerLink]:
    """The link a GpuwatchCallback of this process uses. A closed link leaves SIGUSR1 ignored (a late stop must
    not kill a job's epilogue): both signals are put back, or every child this test process starts later
    would inherit the ignored SIGUSR1."""
    monkeypatch.setenv("GPUWATCH_JOB_ID", "hf-callback-test")
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    yield TrainerLink(tmp_path / "run", report_interval_s=3600.0, gpu_uuid="GPU-test")
    for signum, handler in previous.items():
        signal.signal(signum, handler)
