"""`gpuwatch launch --in-place` refuses a job that never joins the in-place membership, instead of splitting it.

Under --in-place each worker is a job of one until it joins (InPlaceJob). A script that never joins
trained alone on each GPU (Lightning: "MEMBER 1/1" twice, one checkpoint dir), or crashed and was
replaced beyond its GPUs. Now the launch stops it with one line and exit 2, within its bound.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from gpuwatch.inplace.protocol import JOIN, NODE, append_event
from gpuwatch.launcher.join_watch import JoinWatch
from tests.frameworks import jobs
from tests.frameworks.jobs import Node
from tests.helpers import REPO


def test_a_job_is_refused_when_no_worker_joined_within_the_bound_or_all_ended_first() -> None:
    store = dist.HashStore()
    append_event(store, NODE, node=0, workers=2)
    watch = JoinWatch(store, within_s=10.0, started_t=100.0)
    assert watch.refusal(live_workers=2, now=105.0) is None
    assert "no worker joined the job within 10 s of its start" in str(watch.refusal(live_workers=2, now=110.0))
    assert "every worker ended before any joined the job" in str(watch.refusal(live_workers=0, now=101.0))


def test_a_job_that_joined_is_never_refused() -> None:
    store = dist.HashStore()
    watch = JoinWatch(store, within_s=10.0, started_t=100.0)
    append_event(store, JOIN, member="n0.g0.0", node=0)
    assert watch.refusal(live_workers=2, now=105.0) is None
    assert watch.refusal(live_workers=0, now=500.0) is None and watch.joined


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with Node(tmp_path) as daemon:
        yield daemon


def _in_place(node: Node, cwd: Path, *job: str, join_within: str) -> subprocess.Popen[str]:
    command = node.command("launch", "--runtime-dir", str(node.runtime_dir), "--in-place", "--nproc-per-node", "2")
    return subprocess.Popen(
        [*command, "--join-within", join_within, "--", *job],
        env=node.job_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_in_place_refuses_a_script_that_never_joins_within_its_bound(node: Node, tmp_path: Path) -> None:
    script = tmp_path / "never_joins.py"
    script.write_text("import time\ntime.sleep(600)\n")
    started = time.monotonic()
    proc = _in_place(node, tmp_path, str(script), join_within="3")
    _, stderr = proc.communicate(timeout=60)
    took = time.monotonic() - started

    assert proc.returncode == 2, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gpuwatch launch: error: no worker joined the job within 3 s of its start: "), last
    assert "without --in-place" in last and took < 30
    assert "generation" not in stderr and "replacement" not in stderr  # nothing beyond the job's two GPUs


@pytest.mark.slow
def test_lightning_under_in_place_is_refused_before_it_trains_alone(node: Node, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = tmp_path / "out"
    script = str(REPO / "tests" / "frameworks" / "lightning_train.py")
    proc = _in_place(node, tmp_path, script, "--out", str(out), "--log", f"{out}.log", join_within="240")
    _, stderr = proc.communicate(timeout=jobs.TIMEOUT_S)

    assert proc.returncode == 2, stderr[-3000:]
    assert "gpuwatch: Lightning owns its process group and cannot recover in place" in stderr
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith("gpuwatch launch: error: every worker ended before any joined the job: ")
    )
    assert not list(out.glob("*.ckpt"))  # not one step alone, not one checkpoint
    assert all(log.read_text() == "" for log in tmp_path.glob("out.log.rank*"))
