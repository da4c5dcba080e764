"""Recovery with no survivor: a 1-rank job SIGKILLed, resumed from the disk or from a host snapshot.

For each state size (GPU: 1, 4, 16 GiB; CPU: 0.1, 0.5, 2 GiB; --quick: 16 MiB; or the sizes in
$GPUWATCH_BENCH_RECOVERY_GIB, comma-separated) it measures, on the disk the bench's temp dir is on:

* the disk's floor: the same number of bytes written and read by dd, with O_DIRECT and buffered
  (fsync'd; the buffered read after dropping the file's cached pages), and save_checkpoint and
  load_latest (which verifies) against it; at the first size also the format before flat files
  (torch.save + sha256), for before and after;
* what host snapshots cost a job: the same loop's wall time with every="auto" and without (its own
  step times), the K auto chose, the drain (boundary to commit), the mode, and the survivor's rescue
  written from host memory;
* for every entry of RECOVERY_PATHS, a real job under `gpuwatch launch` (beside a bench daemon)
  killed with SIGKILL (what the kill_rank drill sends) after a given step: the seconds from the kill
  to the relaunch's first finished step and the steps lost, from the job's own step log. Another way
  to recover is one more entry of RECOVERY_PATHS returning the same keys: `in_place` kills one of a
  job's ranks and times its survivors' next step (gpuwatch.inplace; two ranks at least).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.bench.daemons import bench_daemon
from gpuwatch.bench.harness import Context, progress
from gpuwatch.bench.report import Row, Section, Skip, target
from gpuwatch.testing.daemon_process import child_env

SIZES_ENV = "GPUWATCH_BENCH_RECOVERY_GIB"
GPU_SIZES_GIB = (1.0, 4.0, 16.0)
CPU_SIZES_GIB = (0.1, 0.5, 2.0)
QUICK_SIZES_GIB = (1 / 64,)
FLOOR_SHARE = 0.70  # save and load+verify against the disk's floor
SNAPSHOT_SHARE = 0.01  # what a snapshot may cost a step
RESCUE_WINDOW_S = 30.0  # torchrun's default --shutdown-timeout: a survivor's rescue must fit in it
SHM_MARGIN = 1.1


@dataclass(frozen=True)
class Trial:
    """One recovery path's run at one state size: what a RECOVERY_PATHS entry gets."""

    ctx: Context
    gib: float
    workdir: Path
    launch_args: tuple[str, ...]  # `gpuwatch launch` options that reach the bench daemon
    step_s: float
    ckpt_every: int
    kill_after: int
    steps: int
    timeout_s: float


RecoveryPath = Callable[[Trial], dict[str, Any]]
"""Runs a trial; returns at least fault_to_step_s and steps_lost (raise Skip when it cannot run here)."""


def run(ctx: Context) -> Section:
    if importlib.util.find_spec("torch") is None:
        raise Skip("needs torch (pip install torch, or the project's test extra)")
    import torch

    from gpuwatch.bench.remediation import launch_available

    if not launch_available():
        raise Skip("`gpuwatch launch` is not available (`gpuwatch launch --help` failed)")
    cuda = torch.cuda.is_available()
    sizes = _sizes(ctx, cuda)
    device = torch.device("cuda:0" if cuda else "cpu")
    section = Section("recovery")
    section.figures = {"device": str(device), "workdir": str(ctx.workdir), "sizes": {}}
    errors: list[str] = []
    step_s = ctx.pick(0.25 if cuda else 0.2, 0.05)
    ckpt_every, kill_after = int(ctx.pick(20, 4)), int(ctx.pick(34, 7))
    with bench_daemon(ctx, "recovery", interval_s=1.0) as daemon:
        launch_args: tuple[str, ...] = ("--runtime-dir", str(daemon.runtime_dir), "--listen", daemon.listen)
        launch_args = (*launch_args, "--state-dir", str(daemon.state_dir))
        for i, gib in enumerate(sizes):
            label = _label(gib)
            entry: dict[str, Any] = {}
            progress(f"recovery {label}: the disk's floor (dd), save_checkpoint and load_latest")
            entry["floor"] = disk_floor(ctx.workdir / "floor", int(gib * 2**30))
            entry["checkpoint"] = checkpoint_throughput(ctx.workdir / "ckpt", gib, device, legacy=i == 0)
            progress(f"recovery {label}: host snapshot cost per step")
            entry["snapshot"] = _guarded(errors, snapshot_cost, ctx, gib, device, step_s)
            progress(f"recovery {label}: host snapshots mode by mode (none, every 8, every 4, auto)")
            entry["snapshot_modes"] = _guarded(errors, snapshot_modes, ctx, gib, device)
            jobs = ctx.workdir / f"jobs-{i}"
            trial = Trial(
                ctx, gib, jobs, launch_args, step_s, ckpt_every, kill_after, kill_after + 4, ctx.pick(300, 180)
            )
            entry["paths"] = {}
            for name, path in RECOVERY_PATHS.items():
                progress(f"recovery {label}: SIGKILL after step {kill_after}, recovery by {name}")
                entry["paths"][name] = _guarded(errors, path, trial)
            section.figures["sizes"][label] = entry
            section.rows += _rows(label, entry)
    section.notes.append(
        f"jobs: 1 rank under gpuwatch launch, a {step_s:g} s step, disk checkpoint every {ckpt_every} steps, "
        f"SIGKILL after step {kill_after}; snapshot path: --snapshot-every auto"
    )
    if not cuda:
        section.notes.append("on the CPU: the snapshot copy competes with the step for cores; the H200 sizes differ")
    if errors:  # the other figures are in the table and the JSON; the run still says it failed
        section.status, section.reason = "error", "; ".join(errors)
    return section


def _guarded(errors: list[str], measure: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """One measurement's figures; a Skip is its reason, a failure its one-line error (the others still run)."""
    try:
        return measure(*args)
    except Skip as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # one measurement that breaks must not lose the others' figures
        message = f"{type(exc).__name__}: {exc}".splitlines()[0]
        errors.append(message)
        return {"error": message}


# -- the disk's floor and the checkpoints' throughput ---------------------------------------------------


def disk_floor(directory: Path, nbytes: int) -> dict[str, float | None]:
    """GiB/s of dd writing (fsync'd) and reading `nbytes`, with O_DIRECT and buffered; None where dd refused."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "dd.bin"
    block = 16 << 20
    count = max(1, math.ceil(nbytes / block))
    out: dict[str, float | None] = {}

    def dd(*args: str) -> float | None:
        return _dd(count * block, ["dd", f"bs={block}", f"count={count}", *args])

    try:
        out["write_direct"] = dd("if=/dev/zero", f"of={path}", "oflag=direct", "conv=fsync")
        out["write_buffered"] = dd("if=/dev/zero", f"of={path}", "conv=fsync")
        _drop_cache(path)
        out["read_buffered"] = dd(f"if={path}", "of=/dev/null")
        out["read_direct"] = dd(f"if={path}", "of=/dev/null", "iflag=direct")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out["write"] = max((v for k, v in out.items() if k.startswith("write") and v), default=None)
    out["read"] = max((v for k, v in out.items() if k.startswith("read") and v), default=None)
    return out


def _dd(nbytes: int, command: list[str]) -> float | None:
    """GiB/s from dd's own timing of `nbytes`; None when dd failed (no O_DIRECT on this file system)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    match = re.search(r"copied, ([0-9.,]+) s", result.stderr)
    if result.returncode != 0 or match is None:
        return None
    seconds = float(match.group(1).replace(",", "."))
    return nbytes / seconds / 2**30 if seconds > 0 else None


def _drop_cache(path: Path) -> None:
    """Evict a file's clean cached pages, so the next read comes from the disk (no root needed)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint_throughput(directory: Path, gib: float, device: Any, *, legacy: bool) -> dict[str, Any]:
    """GiB/s of save_checkpoint and of load_latest (verify included, the cache dropped first); legacy: v1 too."""
    from gpuwatch.examples.recovery_job import make_state, state_of
    from gpuwatch.trainer.checkpoint import load_latest, save_checkpoint

    params, optim = make_state(gib, device)
    state = state_of(params, optim)
    nbytes = _tensor_bytes(state)
    out: dict[str, Any] = {"state_bytes": nbytes}
    try:
        _sync(device)
        started = time.perf_counter()
        path = save_checkpoint(directory, 1, state, keep=1)
        out["save_s"] = time.perf_counter() - started
        for file in path.iterdir():
            _drop_cache(file)
        started = time.perf_counter()
        loaded = load_latest(directory)
        out["load_s"] = time.perf_counter() - started
        assert loaded is not None and loaded.step == 1
        del loaded
        if legacy:
            out["legacy"] = _legacy(directory / "legacy", state)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        del params, optim, state
        _free(device)
    out["save_gib_s"] = nbytes / 2**30 / out["save_s"]
    out["load_gib_s"] = nbytes / 2**30 / out["load_s"]
    return out


def _legacy(directory: Path, state: Any) -> dict[str, float]:
    """The format before flat files, timed the way it ran: torch.save + fsync + a sha256 pass; sha256 + torch.load."""
    import hashlib

    import torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "state.pt"
    nbytes = _tensor_bytes(state)

    def sha256() -> str:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()

    started = time.perf_counter()
    with path.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    sha256()
    save_s = time.perf_counter() - started
    _drop_cache(path)
    started = time.perf_counter()
    sha256()
    torch.load(path, map_location="cpu", weights_only=True)
    load_s = time.perf_counter() - started
    gib = nbytes / 2**30
    return {"save_s": save_s, "load_s": load_s, "save_gib_s": gib / save_s, "load_gib_s": gib / load_s}


# -- what a snapshot costs the step -----------------------------------------------------------------


def snapshot_cost(ctx: Context, gib: float, device: Any, step_s: float) -> dict[str, Any]:
    """The loop's wall time with every="auto" against without; K, the drain, the mode; the rescue from host memory."""
    from gpuwatch.snapshots import snapshot_root

    if (reason := _shm_short(snapshot_root(), int(gib * 2**30))) is not None:
        return {"skipped": reason}
    out = _timed_snapshots(ctx, gib, device, step_s)
    _free(device)
    return out


def _timed_snapshots(ctx: Context, gib: float, device: Any, step_s: float) -> dict[str, Any]:
    """The same loop without snapshots, then with (after a warm-up in which the slots are set up off the step)."""
    from gpuwatch.examples.recovery_job import make_compute, make_state, state_of
    from gpuwatch.snapshots import HostSnapshot

    steps = int(ctx.pick(40, 6))
    params, optim = make_state(gib, device)
    compute = make_compute(device, step_s)
    snap = HostSnapshot(
        lambda: state_of(params, optim), every="auto", share=SNAPSHOT_SHARE, optimizer=optim, replicated=True,
        job_id=f"bench-cost-{os.getpid()}",
    )  # fmt: skip

    def timed(first: int, n: int, with_snapshot: bool) -> tuple[int, list[float]]:
        times = []
        step = first
        for step in range(first, first + n):
            started = time.perf_counter()
            compute()
            optim.step()
            _sync(device)  # the loop's own step log: each step ends when the GPU is done with it
            if with_snapshot:
                snap.step(step)
            times.append(time.perf_counter() - started)
        return step + 1, times

    try:
        step, _ = timed(1, 2, False)
        step, without = timed(step, steps, False)
        warm_up = time.perf_counter() + ctx.pick(120, 30)
        while (snap.every is None or not snap.snapshots) and snap.enabled and time.perf_counter() < warm_up:
            step, _ = timed(step, 1, True)  # the slots are set up here, on their own thread
        step, with_snapshot = timed(step, steps, True)
        snap.wait()
        rescue_dir = ctx.workdir / "rescue"
        started = time.perf_counter()
        snap.rescue(rescue_dir, step)
        rescue_s = time.perf_counter() - started
        shutil.rmtree(rescue_dir, ignore_errors=True)
        stats = snap.stats()
    finally:
        snap.close(remove=True)
    wall, wall_with = sum(without), sum(with_snapshot)
    return {
        "state_bytes": stats["state_bytes"],
        "step_s": _mean(without),
        "wall_s": wall,
        "wall_with_snapshots_s": wall_with,
        "cost_share": wall_with / wall - 1 if wall else None,
        "every": stats["every"],
        "drain_s": stats["drain_s"],
        "mode": stats["mode"],
        "pinned": stats["pinned"],
        "staging_bytes": stats["staging_bytes"],
        "own_cost_s": stats["mean_cost_s"],
        "own_host_s": stats["mean_host_s"],
        "setup_s": stats["setup_s"],
        "rescue_s": rescue_s,
        "device": stats["device"],
    }


def snapshot_modes(ctx: Context, gib: float, device: Any) -> dict[str, Any]:
    """A Linear stack with AdamW under each snapshot mode (recovery_snapshots.py): the rows it reports."""
    from gpuwatch.bench import recovery_snapshots as modes
    from gpuwatch.snapshots import snapshot_root

    if (reason := _shm_short(snapshot_root(), int(gib * 2**30))) is not None:
        return {"skipped": reason}
    cuda = device.type == "cuda"
    loop = modes.build(gib, device, 2048 if cuda else 64, modes.WIDTH if cuda else 1024)
    job, state_gib = f"bench-modes-{os.getpid()}", loop.state_bytes / 2**30
    try:
        runs = modes.measure_modes(loop, int(ctx.pick(300 if cuda else 40, 6)), job)
    finally:
        modes.cleanup(job)
        del loop
        _free(device)
    return {"rows": modes.rows(state_gib, runs)}


# -- a job killed and relaunched ------------------------------------------------------------------------


def relaunch_from_disk(trial: Trial) -> dict[str, Any]:
    """The job checkpoints to disk every ckpt_every steps (in the step); the relaunch loads the newest."""
    return _killed_job(trial, "disk", [])


def relaunch_from_snapshot(trial: Trial) -> dict[str, Any]:
    """The job keeps host snapshots (--snapshot-every auto); the relaunch restores the newest from memory."""
    from gpuwatch.snapshots import snapshot_root

    if (reason := _shm_short(snapshot_root(), int(trial.gib * 2**30))) is not None:
        raise Skip(reason)
    return _killed_job(trial, "snapshot", ["--snapshot-every", "auto"])


def in_place(trial: Trial) -> dict[str, Any]:
    """A job that recovers in place (gpuwatch.inplace): one of its ranks killed, the survivors go on.

    It needs two ranks: on the CPU three gloo ranks, on a GPU machine NCCL on every GPU (at least two).
    """
    import torch

    from gpuwatch.bench.recovery_in_place import measure_in_place

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < 2:
        raise Skip("in place needs two GPUs (NCCL refuses two ranks on one); the CPU's gloo figures stand for it")
    result = measure_in_place(int(trial.gib * 2**30), trial.workdir / "in_place", backend, timeout_s=trial.timeout_s)
    return {**result, "fault_to_step_s": result["fault_to_next_step_s"], "source": "peers' memory"}


def _one_rank_in_place(trial: Trial, *, spare: bool) -> dict[str, Any]:
    """A 1-rank job under the in-place launcher (gpuwatch.examples.sharded_worker, a host snapshot every
    SPARE_EVERY steps), SIGKILLed; its replacement is a warm spare or a cold start (gpuwatch.bench.recovery_spare)."""
    from gpuwatch.bench.recovery_spare import measure_spare
    from gpuwatch.snapshots import snapshot_root

    if (reason := _shm_short(snapshot_root(), int(trial.gib * 2**30))) is not None:
        raise Skip(reason)
    workdir = trial.workdir / ("spare" if spare else "cold")
    (result,) = measure_spare(
        int(trial.gib * 2**30), workdir, spare=spare, every=SPARE_EVERY, step_sleep=min(trial.step_s, 0.1),
        timeout_s=trial.timeout_s,
    )  # fmt: skip
    return {**result, "steps_lost": result["steps_redone"], "source": "memory"}


def spare(trial: Trial) -> dict[str, Any]:
    """The rank's replacement is a warm spare (interpreter and torch started): it restores the host snapshot."""
    return _one_rank_in_place(trial, spare=True)


def cold_start(trial: Trial) -> dict[str, Any]:
    """The same job and fault as `spare`, the replacement started cold: the spare's gain, in the same run."""
    return _one_rank_in_place(trial, spare=False)


SPARE_EVERY = 4
RECOVERY_PATHS: dict[str, RecoveryPath] = {
    "disk": relaunch_from_disk,
    "snapshot": relaunch_from_snapshot,
    "in_place": in_place,
    "spare": spare,
    "cold_start": cold_start,
}


def _killed_job(trial: Trial, name: str, extra: list[str]) -> dict[str, Any]:
    workdir = trial.workdir / name
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    log, ckpt = workdir / "steps.jsonl", workdir / "ckpt"
    job = ["-m", "gpuwatch.examples.recovery_job", "--state-gib", f"{trial.gib:g}", "--ckpt-dir", str(ckpt)]
    job += ["--step-log", str(log), "--steps", str(trial.steps), "--ckpt-every", str(trial.ckpt_every)]
    job += ["--step-s", f"{trial.step_s:g}", *extra]
    args = [sys.executable, "-m", "gpuwatch", "launch", "--nproc-per-node", "1", "--max-restarts", "2"]
    args += [*trial.launch_args, "--", *job]
    with (workdir / "launch.log").open("wb") as out:
        launch = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
        try:
            first = _wait_for(log, launch, trial.timeout_s, lambda lines: _furthest(lines) >= trial.kill_after)
            pid = _launches(first)[0]["pid"]
            killed_t = time.time()
            os.kill(pid, signal.SIGKILL)
            lines = _wait_for(log, launch, trial.timeout_s, lambda lines: _relaunch_stepped(lines))
            launch.wait(timeout=trial.timeout_s)
            lines = _read(log)
        finally:
            if launch.poll() is None:
                os.killpg(launch.pid, signal.SIGTERM)
                launch.wait(timeout=30)
    shutil.rmtree(ckpt, ignore_errors=True)
    launches = _launches(lines)
    before, after = _split(lines)
    furthest = max(line["step"] for line in before if "step" in line)
    first_step = next(line for line in after if "step" in line)
    snapshot = next((line["snapshot"] for line in reversed(lines) if "snapshot" in line), None)
    return {
        "fault_to_step_s": first_step["t"] - killed_t,
        "fault_to_relaunch_s": launches[1]["t"] - killed_t - launches[1]["restore_s"],
        "restore_s": launches[1]["restore_s"],
        "steps_lost": furthest - launches[1]["resumed_from"],
        "killed_after": furthest,
        "resumed_from": launches[1]["resumed_from"],
        "source": launches[1]["source"],
        "every": snapshot["every"] if snapshot else None,
        "launch_rc": launch.returncode,
    }


def _wait_for(
    log: Path, launch: subprocess.Popen[bytes], timeout_s: float, done: Callable[[list[dict[str, Any]]], bool]
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = _read(log)
        if lines and done(lines):
            return lines
        if launch.poll() is not None:
            raise RuntimeError(f"gpuwatch launch exited {launch.returncode} early: {_tail(log.parent / 'launch.log')}")
        time.sleep(0.05)
    raise RuntimeError(f"the job did not get there within {timeout_s:g} s: {_tail(log.parent / 'launch.log')}")


def _read(log: Path) -> list[dict[str, Any]]:
    lines = []
    with contextlib.suppress(FileNotFoundError):
        for text in log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                lines.append(json.loads(text))
    return lines


def _launches(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if "launch" in line]


def _split(lines: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    second = [i for i, line in enumerate(lines) if "launch" in line][1]
    return lines[:second], lines[second:]


def _furthest(lines: list[dict[str, Any]]) -> int:
    return max((line["step"] for line in lines if "step" in line), default=0)


def _relaunch_stepped(lines: list[dict[str, Any]]) -> bool:
    launches = [i for i, line in enumerate(lines) if "launch" in line]
    return len(launches) >= 2 and any("step" in line for line in lines[launches[1] :])


def _tail(path: Path) -> str:
    with contextlib.suppress(OSError):
        kept = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
        return kept[-1].strip() if kept else "(empty log)"
    return "(no log)"


# -- the table ------------------------------------------------------------------------------------------


def _rows(label: str, entry: dict[str, Any]) -> list[Row]:
    floor, ckpt, snap = entry["floor"], entry["checkpoint"], entry["snapshot"]
    share = FLOOR_SHARE * 100
    rows = [
        Row(f"{label}: dd write (direct / buffered)", _pair(floor["write_direct"], floor["write_buffered"])),
        Row(f"{label}: dd read (buffered cold / direct)", _pair(floor["read_buffered"], floor["read_direct"])),
        Row(f"{label}: save_checkpoint", ckpt["save_gib_s"], "GiB/s"),
        target(
            f"{label}: save_checkpoint / dd write", _pct(ckpt["save_gib_s"], floor["write"]), "%", share, at_most=False
        ),
        Row(f"{label}: load_latest (verify included, cold)", ckpt["load_gib_s"], "GiB/s"),
        target(f"{label}: load / dd read", _pct(ckpt["load_gib_s"], floor["read"]), "%", share, at_most=False),
    ]
    if "legacy" in ckpt:
        legacy = ckpt["legacy"]
        before = _pair(legacy["save_gib_s"], legacy["load_gib_s"])
        rows.append(Row(f"{label}: before (torch.save + sha256): save / load", before))
    if "skipped" in snap or "error" in snap:
        rows.append(Row(f"{label}: host snapshot", _why(snap)))
    else:
        cost_pct = None if snap["cost_share"] is None else 100 * snap["cost_share"]
        walls = f"{snap['wall_with_snapshots_s']:.2f} / {snap['wall_s']:.2f} s"
        rows += [
            Row(f"{label}: step time (no snapshot)", snap["step_s"], "s"),
            Row(f"{label}: host snapshot mode", f"{snap['mode']}, {'pinned' if snap['pinned'] else 'pageable'} slots"),
            Row(f"{label}: the loop's wall time, snapshots every=auto / none", walls),
            target(f"{label}: what snapshots cost the loop (auto)", cost_pct, "%", SNAPSHOT_SHARE * 100),
            Row(f"{label}: snapshot cadence K (auto)", snap["every"], "steps"),
            Row(f"{label}: a snapshot's cost to the loop / of it on the training thread", _pair_ms(snap)),
            Row(f"{label}: snapshot drain (boundary → commit)", snap["drain_s"], "s"),
            target(f"{label}: rescue written from host memory", snap["rescue_s"], "s", RESCUE_WINDOW_S),
        ]
    rows += _mode_rows(label, entry.get("snapshot_modes", {}))
    for name, result in entry["paths"].items():
        if "skipped" in result or "error" in result:
            rows.append(Row(f"{label}: relaunch from {name}", _why(result)))
            continue
        rows += [
            Row(f"{label}: SIGKILL → first resumed step ({name})", result["fault_to_step_s"], "s"),
            Row(f"{label}: steps lost ({name}{_every(result)})", result["steps_lost"], "steps"),
        ]
        if result.get("restore_s") is not None:
            rows.append(Row(f"{label}: restore ({name}: from {result['source']})", result["restore_s"], "s"))
        if result.get("rejoin_s") is not None:
            rows.append(
                Row(f"{label}: a replacement joins from its peers (start → its first step)", result["rejoin_s"], "s")
            )
    return rows


def _mode_rows(label: str, result: dict[str, Any]) -> list[Row]:
    """One row per snapshot mode: the loop's wall time, steady and longest step against the plain loop, and what
    the snapshots took and promise."""
    if "skipped" in result or "error" in result:
        return [Row(f"{label}: host snapshots by mode", _why(result))]
    out = []
    for r in result.get("rows", []):
        text = (f"wall {r['wall_s']:.2f} s ({r['wall_vs_plain']:+.2%}), steady step {r['steady_ms']:.2f} ms "
                f"({r['steady_vs_plain']:+.2%}), longest {r['longest_ms']:.1f} ms ({r['longest_x_plain']:.1f}x); "
                f"GPU {r['gpu_mib']:g} MiB, K {r['K'] or '-'}, {r['snapshot_mode'] or '-'}, "
                f"loses <= {r['loss_bound_steps'] or '-'} steps")  # fmt: skip
        out.append(Row(f"{label}: Linear+AdamW loop, snapshots {r['mode']}", text))
    return out


def _why(result: dict[str, Any]) -> str:
    return f"skipped: {result['skipped']}" if "skipped" in result else f"error: {result['error']}"


def _every(result: dict[str, Any]) -> str:
    return f", K={result['every']}" if result.get("every") else ""


def _pair(a: float | None, b: float | None) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in (a, b)) + " GiB/s"


def _pair_ms(snap: dict[str, Any]) -> str:
    """A snapshot's mean cost to the loop, and of it the training thread's own time, in ms."""
    return " / ".join("-" if v is None else f"{1e3 * v:.2f}" for v in (snap["own_cost_s"], snap["own_host_s"])) + " ms"


def _pct(value: float | None, floor: float | None) -> float | None:
    return None if value is None or not floor else 100.0 * value / floor


# -- helpers --------------------------------------------------------------------------------------------


def _sizes(ctx: Context, cuda: bool) -> tuple[float, ...]:
    raw = os.environ.get(SIZES_ENV)
    if raw:
        try:
            sizes = tuple(float(part) for part in raw.split(",") if part.strip())
        except ValueError:
            sizes = ()
        if not sizes or any(not s > 0 for s in sizes):
            raise ValueError(f"{SIZES_ENV}={raw!r}: expected positive GiB figures separated by commas")
        return sizes
    if ctx.quick:
        return QUICK_SIZES_GIB
    return GPU_SIZES_GIB if cuda else CPU_SIZES_GIB


def _label(gib: float) -> str:
    return f"{gib:g} GiB" if gib >= 0.1 else f"{gib * 1024:g} MiB"


def _shm_short(root: str, nbytes: int) -> str | None:
    """Why the shared-memory file system cannot hold two slots of `nbytes` (None: it can)."""
    try:
        st = os.statvfs(root)
    except OSError as exc:
        return f"{root}: {exc.strerror}"
    free = st.f_bavail * st.f_frsize
    if free < 2 * nbytes * SHM_MARGIN:
        return f"{root} has {free / 2**30:.1f} GiB free, two slots need {2 * nbytes / 2**30:.1f} GiB"
    return None


def _tensor_bytes(state: Any) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
