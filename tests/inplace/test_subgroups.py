"""Groups a job makes after its default group prove themselves: a 2-D mesh's subgroups, new_group.

Real gloo ranks start through gpuwatch.launcher.worker_store (what `gpuwatch launch` runs) against the
launch's authenticated store hosted here. A rank that sends a wrong proof once stands in for a stranger
holding a member's pair (tests/hardening/test_later_group_stranger.py runs the real race as another
user): its group must be refused on every member, one line and a count, and formed again.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow  # real worker processes (torch's import: seconds each on a loaded machine)
from gpuwatch.inplace.jobstore import StoreServer  # noqa: E402  (needs torch)
from gpuwatch.inplace.secret import read_secret  # noqa: E402
from gpuwatch.launcher.worker_plane import write_secret  # noqa: E402
from tests.launcher.test_launch_worker_store import _workers  # noqa: E402

# FORGE names the rank whose next proofs over a later group are wrong (how many: FORGE_TIMES).
JOB = """
import json, os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from gpuwatch.inplace import groupproof
dist.init_process_group("gloo")
rank = dist.get_rank()
forge = json.loads(os.environ.get("FORGE", "[-1, 0]"))
if rank == forge[0]:  # this rank's next forge[1] proofs over later groups use a wrong secret
    left, real = [forge[1]], groupproof._prove
    def _prove(store, secret, *args):
        if left[0] > 0:
            left[0] -= 1
            secret = b"not the job's secret"
        return real(store, secret, *args)
    groupproof._prove = _prove
out = {"rank": rank}
try:
    SHAPE
    for name, group in groups.items():
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        t = torch.full((1,), float(rank)); dist.all_reduce(t, group=group)
        out[name] = [t.item(), dist.get_process_group_ranks(group)]
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
out["refused"] = groupproof.refused()
print(json.dumps(out), flush=True)
"""
MESH = """mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    groups = {n: mesh.get_group(d) for d, n in enumerate(mesh.mesh_dim_names)}"""
PAIR = 'groups = {"pair": dist.new_group([1, 3])}'


def _run(
    tmp_path: Path, forge: tuple[int, int] | None, shape: str = MESH
) -> tuple[list[dict[str, object]], list[str], list[bytes], float]:
    secret = write_secret(tmp_path / "secret")
    (tmp_path / "job.py").write_text(JOB.replace("SHAPE", shape))
    server = StoreServer("127.0.0.1", 0, read_secret(secret))
    started = time.monotonic()
    try:
        env = {"FORGE": json.dumps(list(forge))} if forge else {}
        workers = _workers(["job.py"], tmp_path, server.port, secret, world=4, env=env)
        outs = [w.communicate(timeout=180) for w in workers]
        seconds = time.monotonic() - started
        with server.data.lock:
            verdicts = [v for k, v in server.data.values.items() if re.search(r"gpuwatch-proof/.*/verdict/\d$", k)]
    finally:
        server.close()
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], [err for _, err in outs], verdicts, seconds


def test_each_subgroup_of_a_2d_mesh_proves_itself_before_the_script_gets_it(tmp_path: Path) -> None:
    results, errs, verdicts, _ = _run(tmp_path, None)
    for r in results:
        rank = int(r["rank"])  # type: ignore[call-overload]
        dp, tp = [rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]
        assert r.get("dp") == [float(sum(dp)), dp] and r.get("tp") == [float(sum(tp)), tp], (r, errs[rank][-2000:])
        assert r["refused"] == 0
    assert verdicts == [b"ok"] * 8  # 4 subgroups of 2: every member's verdict, in the authenticated store


def test_a_wrong_proof_in_one_subgroup_refuses_it_on_every_member_and_it_is_formed_again(tmp_path: Path) -> None:
    results, errs, verdicts, seconds = _run(tmp_path, (3, 1))
    by_rank = {int(r["rank"]): r for r in results}  # type: ignore[call-overload]
    assert all("error" not in r for r in results), errs
    # rank 3's first subgroup is dp's [1, 3]: refused on both its members, then formed again and right
    assert by_rank[1]["dp"] == [4.0, [1, 3]] and by_rank[3]["dp"] == [4.0, [1, 3]]
    assert by_rank[3]["tp"] == [5.0, [2, 3]] and by_rank[0]["dp"] == [2.0, [0, 2]]
    assert [by_rank[r]["refused"] for r in range(4)] == [0, 1, 0, 1]
    for rank in (1, 3):
        lines = [line for line in errs[rank].splitlines() if "did not prove itself" in line]
        assert len(lines) == 1 and "ranks 1, 3" in lines[0] and "1 refused in this process" in lines[0], errs[rank]
    assert verdicts.count(b"ok") == 8 and len(verdicts) == 10
    assert seconds < 120


def test_a_new_group_that_never_proves_itself_raises_on_its_members_in_bounded_time(tmp_path: Path) -> None:
    results, errs, _, seconds = _run(tmp_path, (3, 99), PAIR)
    by_rank = {int(r["rank"]): r for r in results}  # type: ignore[call-overload]
    for rank in (1, 3):
        assert "GroupProofError" in str(by_rank[rank].get("error")), errs[rank][-2000:]
        assert "no group proved itself in 5 attempts" in str(by_rank[rank]["error"])
    assert by_rank[1]["refused"] == 5
    assert "pair" not in by_rank[0] and "error" not in by_rank[0]  # not a member: new_group returned at once
    assert seconds < 150
