"""Recovery in place across two sim nodes on one machine: two daemons (2 GPUs each), two
`gpuwatch launch --in-place --nnodes 2` sharing one job store at --rdzv-endpoint (whichever launcher
binds it hosts it, the other connects), 4 gloo ranks. A quarantine on node B takes the job to 3 ranks
in the same processes; the release brings it back to 4 with the state from a peer.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.testing.daemon_process import DaemonProcess, free_port
from tests.inplace.jobs import assert_no_step_lost_or_repeated, first_after, launch_in_place, post, sim_node

pytestmark = pytest.mark.slow


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[DaemonProcess, DaemonProcess]]:
    with sim_node(tmp_path / "a", gpus=2, seed=1) as a, sim_node(tmp_path / "b", gpus=2, seed=2) as b:
        yield a, b


def test_two_nodes_shrink_from_4_to_3_ranks_in_place_and_grow_back_to_4(
    nodes: tuple[DaemonProcess, DaemonProcess], tmp_path: Path
) -> None:
    a, b = nodes
    secret = tmp_path / "job.secret"  # the job's secret, a file of the user's own on a shared filesystem
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    rdzv = ("--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "two-nodes")
    rdzv += ("--inplace-secret-file", str(secret))
    (tmp_path / "job").mkdir()
    runs = [launch_in_place(a, tmp_path / "job", 100_000, *rdzv), launch_in_place(b, tmp_path / "job", 100_000, *rdzv)]
    run = runs[0]  # both write their step logs into the same directory (a shared filesystem's role)
    try:
        run.wait_for("4 ranks past step 20", lambda lines: len(run.ranks_at(20, 4)) == 4)
        on_b = {r["gpu"]: r["pid"] for r in b.get("/v1/trainers")["ranks"]}
        leaving = on_b[1]
        before = {ln["pid"] for ln in run.steps()}
        decided = post(b, "/v1/gpus/1/quarantine", {"reason": "test"})
        run.wait_for("3 ranks", lambda lines: len({ln["pid"] for ln in lines if ln["world"] == 3}) == 3)
        survivors = sorted(before - {leaving})
        lines = run.steps()
        first = first_after(lines, decided, survivors, world=3)
        assert {ln["pid"] for ln in lines if ln["world"] == 3} == set(survivors)
        assert first["t"] - decided <= 3.0 and first["change"]["source"] == "held", first

        post(b, "/v1/gpus/1/release", {"reason": "test", "force": True})
        run.wait_for(
            "4 ranks again",
            lambda lines: len({ln["pid"] for ln in lines if ln["generation"] >= 3 and ln["world"] == 4}) == 4,
        )
        lines = run.steps()
        newest = max(ln["generation"] for ln in lines)
        joiner = next(ln for ln in lines if ln["generation"] == newest and ln["pid"] not in before)
        assert joiner["change"]["source"] == "peer", joiner
        at = {ln["pid"]: ln["checksum"] for ln in lines if ln["step"] == joiner["step"] and ln["generation"] == newest}
        assert len(at) == 4 and len(set(at.values())) == 1, at
        assert_no_step_lost_or_repeated(lines, survivors)
        print(
            f"\ntwo nodes in place: 4 -> 3 ranks, next step {first['t'] - decided:.2f} s after the decision;"
            " 3 -> 4 ranks, checksums equal"
        )
    finally:
        for proc in (r.process for r in runs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
    stderrs = [r.output()[1] for r in runs]
    assert not any("loaded checkpoint" in err for err in stderrs), stderrs
