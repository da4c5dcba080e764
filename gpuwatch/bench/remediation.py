"""Remediation: quarantine decision → trainer stop → checkpoint → relaunch → first resumed step.

The example trainer runs on two GPUs under `gpuwatch launch` beside a daemon that may quarantine
(this is the one measurement that lets it); an XID 79 injected on GPU 1 makes it unhealthy, the daemon
quarantines it and stops the job, `launch` relaunches on the healthy GPU and the job resumes from
its checkpoint. The figures are the incident's (GET /v1/incidents). On the sim backend the trainer
runs on the CPU (gloo); on NVML it runs on the first two GPUs, so it refuses GPUs where any process
runs already: a quarantine signals every process on the GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpuwatch.bench.daemons import bench_daemon
from gpuwatch.bench.harness import Context, Http, progress
from gpuwatch.bench.report import Row, Section, Skip, target
from gpuwatch.bench.sampling import bench_config, open_backend
from gpuwatch.serving import wire
from gpuwatch.testing.daemon_process import child_env

RESUME_TARGET_S = 30.0
FAULT_GPU = 1


def launch_available() -> bool:
    """Whether this gpuwatch has `launch` (another part of the project; the bench works without it)."""
    probe = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "launch", "--help"], capture_output=True, timeout=60, check=False
    )
    return probe.returncode == 0


AFTER_EXIT_S = 5.0  # how long the daemon may take to see a relaunch that already finished


def run(ctx: Context) -> Section:
    if importlib.util.find_spec("torch") is None:
        raise Skip("needs torch for the example trainer (pip install torch, or the project's test extra)")
    if not launch_available():
        raise Skip("`gpuwatch launch` is not available yet (`gpuwatch launch --help` failed)")
    if ctx.gpus < 2:
        raise Skip(f"needs 2 GPUs, this run has {ctx.gpus}")
    if ctx.backend != "sim":
        _refuse_busy_gpus(ctx)
    steps, warm_steps = int(ctx.pick(300, 40)), int(ctx.pick(40, 10))
    report_s = ctx.pick(2.0, 0.5)  # the trainer's report interval: the default, or quicker for a smoke run
    timeout_s = ctx.pick(300.0, 120.0)
    may_quarantine = {"policy": {"quarantine_on_unhealthy": True}}
    with bench_daemon(ctx, "remediation", interval_s=1.0, tables=may_quarantine) as daemon:
        ckpt = daemon.root / "ckpt"
        args = [sys.executable, "-m", "gpuwatch", "launch", "--nproc-per-node", "2", "--min-nproc", "1"]
        args += ["--max-restarts", "3", "--runtime-dir", str(daemon.runtime_dir), "--listen", daemon.listen]
        args += ["--state-dir", str(daemon.state_dir), "--", "-m", "gpuwatch.examples.trainer"]  # torchrun runs it
        args += ["--steps", str(steps), "--ckpt-dir", str(ckpt), "--step-sleep", "0.05"]
        args += ["--report-interval", f"{report_s:g}"]
        out_path, log_path = daemon.root / "launch.out", daemon.root / "launch.log"
        progress(f"remediation: example trainer, {steps} steps on 2 GPUs under gpuwatch launch")
        with out_path.open("wb") as out, log_path.open("wb") as log:
            launch = subprocess.Popen(args, stdout=out, stderr=log, env=child_env(), start_new_session=True)
            try:
                _wait_for_step(ckpt, warm_steps, launch, log_path, timeout_s)
                http = Http(daemon.port)
                try:
                    progress(f"remediation: XID 79 on GPU {FAULT_GPU}, waiting for the resumed step")
                    injected = time.monotonic()
                    http.post_json(f"/v1/gpus/{FAULT_GPU}/inject", {"event": "xid", "xid": 79}, daemon.token)
                    incident = _wait_for_resume(http, launch, log_path, timeout_s)
                    seen_s = time.monotonic() - injected
                finally:
                    http.close()
                with contextlib.suppress(subprocess.TimeoutExpired):  # the figures are in; the summary is a bonus
                    launch.wait(timeout=timeout_s)
            finally:
                if launch.poll() is None:
                    os.killpg(launch.pid, signal.SIGTERM)
                    launch.wait(timeout=30)
    summary = _summary(out_path)
    section = Section("remediation")
    section.figures = {
        "backend": ctx.backend,
        "steps": steps,
        "trainer_report_interval_s": report_s,
        "fault": f"XID 79 on GPU {FAULT_GPU}",
        "time_to_stop_s": incident.time_to_stop_s,
        "time_to_resume_s": incident.time_to_resume_s,
        "steps_lost": incident.steps_lost,
        "inject_to_resume_seen_s": seen_s,
        "incident": incident.model_dump(mode="json"),
        "trainer_summary": summary,
    }
    section.rows += [
        Row("decision → trainers stopped", _number(incident.time_to_stop_s), "s"),
        target("decision → first resumed step", _number(incident.time_to_resume_s), "s", RESUME_TARGET_S),
        Row("steps lost (incident)", _number(incident.steps_lost), "steps"),
        Row("steps lost (the trainer's own count)", _number((summary or {}).get("lost_steps")), "steps"),
        Row("injection → resume seen by the bench", seen_s, "s"),
    ]
    if ctx.backend == "sim":
        section.notes.append("trainer on the CPU (gloo); the target is for two H200s")
    return section


def _refuse_busy_gpus(ctx: Context) -> None:
    backend, statics = open_backend(ctx, bench_config(ctx))
    try:
        busy = [s.index for s in statics[:2] if backend.sample(s.index, time.time()).pids]
    finally:
        backend.close()
    if busy:
        raise Skip(f"GPU(s) {busy} run processes already; quarantining them would signal those processes")


def _wait_for_step(ckpt: Path, step: int, launch: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until the trainer's own progress file says it reached `step`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _still_running(launch, log)
        try:
            launches = json.loads((ckpt / "progress.json").read_text())["launches"]
        except (OSError, ValueError, KeyError):
            launches = []
        if launches and launches[-1]["furthest"] >= step:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the trainer did not reach step {step} within {timeout_s:g} s: {_tail(log)}")


def _wait_for_resume(http: Http, launch: subprocess.Popen[bytes], log: Path, timeout_s: float) -> wire.Incident:
    """The first incident whose job has resumed, from GET /v1/incidents.

    The daemon learns of the resume from the relaunch's reports, which stay readable for a while after
    the job ends, so a launcher that has exited gets AFTER_EXIT_S more before the bench says no.
    """
    deadline = time.monotonic() + timeout_s
    incidents: list[wire.Incident] = []
    exited = False
    while time.monotonic() < deadline:
        incidents = wire.read(wire.Incidents, http.get_json("/v1/incidents"), "GET /v1/incidents").incidents
        for incident in incidents:
            if incident.time_to_resume_s is not None:
                return incident
        if launch.poll() is not None and not exited:
            exited, deadline = True, min(deadline, time.monotonic() + AFTER_EXIT_S)
        time.sleep(0.25)
    seen = "; ".join(f"{i.kind} on GPU {i.gpu} {i.status}, last step {i.last_step}" for i in incidents)
    if launch.poll() is not None:
        raise RuntimeError(
            f"gpuwatch launch exited {launch.returncode} with no resumed incident (incidents: {seen or 'none'}): "
            f"{_tail(log)}"
        )
    raise RuntimeError(f"no incident with time_to_resume_s within {timeout_s:g} s (incidents: {seen or 'none'})")


def _still_running(launch: subprocess.Popen[bytes], log: Path) -> None:
    if launch.poll() is not None:
        raise RuntimeError(f"gpuwatch launch exited {launch.returncode} early: {_tail(log)}")


def _summary(out_path: Path) -> dict[str, Any] | None:
    """The example trainer's JSON summary (its last stdout line), when the job finished."""
    for line in reversed(out_path.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                summary: dict[str, Any] = json.loads(line)
            except ValueError:
                return None
            return summary
    return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _tail(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"
