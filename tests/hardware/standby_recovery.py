#!/usr/bin/env python3
"""A standby spare against today's spare on one GPU: fault → the loop's next step, from the loop's own log.

    python tests/hardware/standby_recovery.py --device cuda --gib 16 --kinds standby        # one GPU call
    python tests/hardware/standby_recovery.py --device cuda --gib 16 --kinds standby,spare  # a second one
    python tests/hardware/standby_recovery.py --device cuda --gib 4                         # 4 GiB, both kinds
    python tests/hardware/standby_recovery.py --device cpu --small                          # the same chain on the CPU

A user's loop (tests/spares/user_loop.py: `nn.Sequential` of 4096x4096 fp32 Linear layers built on the
CPU with torch's default init, then `.to(device)`; AdamW; a data index built before the job object;
`ShardedJob` with a host snapshot every 8 steps) runs under `gpuwatch launch --in-place --spares 1`
with the daemon (nvml on a GPU, sim on the CPU) at its default config but a 1 s sample interval. For
each state size (parameters and AdamW's moments: 4 and 16 GiB) and each kind of spare (`standby`: the
spare ran the script up to its join; `spare`: today's, which imported torch and made its CUDA
context, trainer.spare_standby = false) one launch takes three faults in turn, each once the next
spare is ready and the live rank committed a host snapshot of its own (its slots are set up): kill -9 of
the rank, its own XID 31 (`gpuwatch drill --fault-rank 0`; GPU only) and
SIGSTOP (`gpuwatch drill --hang-rank 0`: the daemon's hang rule kills the stopped rank). The fault's
time is the kill's, or a drill's own start (`started` in its --json verdict: its first step sends the
signal; without a verdict, the rank's last step before it, which errs long by less than a step). The
cold start is the first rank's own start → its first step in the same run. Prints a markdown table,
then the whole result as JSON (--out: also to that file, each launch's whole log beside it as
`<out>.<kind>-<gib>GiB.launch.log`, and the daemon's as `<out>.daemon.log`). Each step
is said on stderr as it ends, with its seconds (`standby_recovery: ...`), and each row's `phases_s` says
where the launch's wall time went (the first step, each wait for the next spare to be ready, each fault
to the next step, the drill's own end, the launch's end); `--wait-s` bounds each wait, so one stuck
launch costs at most that and the others still run. Each fault's `onset_error_s` is the daemon's incident
onset (`began_t`) less the fault's time, and `snapshots` says each rank process's host snapshot mode, its
staging bytes and its GPU budget with the reason (a standby's room is left on the GPU by default).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, run as a script

from gpuwatch.testing.daemon_process import DaemonProcess, child_env, wait_until  # noqa: E402
from tests.hardware.hang_drill import spare_warm  # noqa: E402

LOOP = Path(__file__).resolve().parents[1] / "spares" / "user_loop.py"
EVERY = 8


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--small", action="store_true", help="CPU sizes: 0.02 and 0.06 GiB, a 512 wide model")
    parser.add_argument("--gib", type=float, nargs="+", help="state sizes (default 4 16; --small 0.02 0.06)")
    parser.add_argument("--kinds", nargs="+", default=["standby", "spare"], help="standby, spare (or standby,spare)")
    parser.add_argument("--faults", nargs="+", help="default kill xid stop (cuda), kill stop (cpu)")
    parser.add_argument("--wait-s", type=float, default=120.0, help="the longest any one wait may take")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    args.kinds = [k for item in args.kinds for k in item.split(",") if k]
    if not args.kinds or set(args.kinds) - {"standby", "spare"}:
        parser.error(f"--kinds takes standby and spare, not {' '.join(args.kinds)!r}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    sizes = args.gib or ([0.02, 0.06] if args.small else [4.0, 16.0])
    faults = args.faults or (["kill", "xid", "stop"] if args.device == "cuda" else ["kill", "stop"])
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-standby-"))
    sim = ["--sim-gpus", "1", "--sim-scenario", "healthy"] if args.device == "cpu" else []
    daemon = DaemonProcess(work / "node", *sim, "--interval", "1", backend="sim" if sim else "nvml")
    rows: list[dict[str, Any]] = []
    try:
        daemon.start()
        for gib in sizes:
            for kind in args.kinds:
                rows.append(_one_launch(daemon, work / f"{kind}-{gib}", gib, kind, faults, args))
        rows_incidents = daemon.get("/v1/incidents?limit=50")["incidents"]
        for row in rows:
            for fault in row["faults"]:
                found = [i for i in rows_incidents if fault.get("victim") in {r["pid"] for r in i["ranks"]}]
                if found:
                    keys = ("kind", "path", "time_to_resume_s", "steps_lost", "began_t")
                    fault["incident"] = {k: found[0].get(k) for k in keys}
                    # the incident's onset against the fault's time (a kill's; a drill's: the rank's last step)
                    fault["onset_error_s"] = round(found[0]["began_t"] - fault["fault_t"], 3)
    finally:
        daemon.stop()
        if args.out:  # the daemon's whole log beside the result: its verdicts and the signals it sent
            shutil.copyfile(daemon.log_path, Path(args.out).with_suffix(".daemon.log"))
    print(_table(rows, faults))
    text = json.dumps({"device": args.device, "every": EVERY, "rows": rows}, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if all(f.get("next_step_s") is not None for row in rows for f in row["faults"]) else 1


def _one_launch(
    daemon: DaemonProcess, work: Path, gib: float, kind: str, faults: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    work.mkdir(parents=True)
    logs = work / "steps"
    env = child_env(("GPUWATCH_", "TORCHELASTIC_"))
    # The host snapshots in memory (tmpfs), removed after the launch: 16 GiB of state keeps up to 32 GiB there.
    shm = Path(tempfile.mkdtemp(prefix="gpuwatch-standby-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    env.update(GPUWATCH_SNAPSHOT_ROOT=str(shm), GPUWATCH_TRAINER_SPARE_STANDBY=str(kind == "standby").lower())
    if args.device == "cuda":
        env["GPUWATCH_TRAINER_SPARE_CUDA_CONTEXT"] = "true"
    width = "512" if args.small else "4096"
    loop = [str(LOOP), "--log-dir", str(logs), "--steps", "1000000", "--every", str(EVERY), "--gib", str(gib)]
    loop += ["--width", width, "--device", args.device, "--allow-drills", "--step-sleep", "0.02"]
    launch_args = ["launch", "--runtime-dir", str(daemon.runtime_dir), "--in-place", "--spares", "1"]
    log = open(work / "launch.log", "w")  # noqa: SIM115  # the launcher's, for as long as it runs
    launch = subprocess.Popen(
        [*daemon.command(*launch_args), "--", *loop], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    row: dict[str, Any] = {"gib": gib, "kind": kind, "faults": []}
    phases = _Phases(f"{gib:g} GiB {kind}")
    row["phases_s"] = phases.done
    try:
        wait_until("the first step", lambda: bool(_lines(logs)), max(args.wait_s, 300), 0.2)
        phases.end("first step")
        first = min(_lines(logs), key=lambda ln: ln["t"])
        row["cold_start_s"] = round(first["t"] - first["started"], 2)
        row["setup_s"] = round(first["setup_s"], 2)
        row["snapshots"] = _snapshot_budgets(logs)
        for fault in faults:
            wait_until(f"a ready {kind}", lambda: _ready(kind, logs), args.wait_s, 0.1)
            phases.end(f"{fault}: the next {kind} ready")
            # The live rank committed a host snapshot of its own (its slots are set up): a fault before that rolls
            # back to its predecessor's snapshot, or to the job's start when there is none.
            wait_until("the rank's own snapshot", lambda: _own_snapshot_committed(logs), args.wait_s, 0.1)
            phases.end(f"{fault}: the rank's own snapshot committed")
            row.setdefault("spare_memory", _spare_memory(kind, logs))
            row["faults"].append(_fault(daemon, logs, fault, env, kind, args.wait_s, phases))
            row["snapshots"] = _snapshot_budgets(logs)
    except Exception as exc:  # one launch's failure is said in its row; the others still run
        row["error"] = f"{type(exc).__name__}: {exc}"
        phases.end(f"failed: {row['error'][:80]}")
    finally:
        launch.send_signal(signal.SIGTERM)
        try:
            launch.wait(60)
        except subprocess.TimeoutExpired:
            launch.kill()
        log.close()
        shutil.rmtree(shm, ignore_errors=True)
        phases.end("the launch's end")
        row["launch_log_tail"] = (work / "launch.log").read_text()[-1500:]
        if args.out:  # the whole log beside the result: which spare took each rank, and why
            out = Path(args.out)
            shutil.copyfile(work / "launch.log", out.with_name(f"{out.stem}.{kind}-{gib:g}GiB.launch.log"))
    return row


class _Phases:
    """Where a launch's wall time goes: each phase's seconds, said on stderr as it ends."""

    def __init__(self, label: str) -> None:
        self.label, self._at, self._start = label, time.monotonic(), time.monotonic()
        self.done: dict[str, float] = {}

    def end(self, name: str) -> None:
        now = time.monotonic()
        self.done[name] = round(now - self._at, 2)
        self._at = now
        print(f"standby_recovery: {self.label}: {name} {self.done[name]:.2f} s ({now - self._start:.1f} s in)",
              file=sys.stderr, flush=True)  # fmt: skip


def _ready(kind: str, logs: Path) -> bool:
    """standby: a process finished the loop's set-up (its setup file) and took no step yet; spare: a warm spare."""
    if kind == "spare":
        return spare_warm()
    stepped = {ln["pid"] for ln in _lines(logs)}
    waiting = [p for p in logs.glob("setup.*.json") if int(p.name.split(".")[1]) not in stepped]
    return any(Path(f"/proc/{p.name.split('.')[1]}").exists() for p in waiting)


def _spare_memory(kind: str, logs: Path) -> dict[str, Any]:
    """What the waiting spare holds: its resident host memory (/proc) and its GPU memory (NVML, when there)."""
    if kind == "standby":
        stepped = {ln["pid"] for ln in _lines(logs)}
        pids = [int(p.name.split(".")[1]) for p in logs.glob("setup.*.json")]
        pids = [pid for pid in pids if pid not in stepped and Path(f"/proc/{pid}").exists()]
    else:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_waiting_spare(int(p))]
    if not pids:
        return {}
    pid = pids[0]
    found: dict[str, Any] = {"pid": pid}
    try:
        rss = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
        found["host_rss_mib"] = round(int(rss.split()[1]) / 1024)
    except (OSError, StopIteration):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == pid and process.usedGpuMemory is not None:
                found["gpu_mib"] = round(process.usedGpuMemory / 2**20)
    except Exception as exc:  # no NVML (the CPU run), or another PID namespace
        found["gpu"] = f"not read: {type(exc).__name__}"
    return found


def _is_waiting_spare(pid: int) -> bool:
    try:
        if b"gpuwatch.spares.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        return b"GPUWATCH_SPARE_NOW" not in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def _fault(
    daemon: DaemonProcess, logs: Path, fault: str, env: dict[str, str], kind: str, wait_s: float, phases: _Phases
) -> dict[str, Any]:
    if kind == "standby":
        time.sleep(1.0)  # the standby from its set-up file to its join (the launcher then knows it is there)
    victim = max(_lines(logs), key=lambda ln: ln["t"])["pid"]
    drill = None
    verdict_path = logs.parent / f"drill-{fault}.json"
    if fault == "kill":
        at = time.time()
        os.kill(victim, signal.SIGKILL)
    else:
        wait_until("the rank listed on GPU 0", lambda: _listed(daemon, victim), wait_s, 0.1)
        flag = "--fault-rank" if fault == "xid" else "--hang-rank"
        with verdict_path.open("w") as verdict:
            drill = subprocess.Popen(
                daemon.command("drill", flag, "0", "--yes", "--json"),
                env=env,
                stdout=verdict,
                stderr=subprocess.DEVNULL,
            )

    def next_step() -> bool:
        if drill is not None and drill.poll() not in (None, 0):  # refused (a GPU its own XIDs degraded), or failed
            said = verdict_path.read_text()[:300] if verdict_path.exists() else ""
            raise RuntimeError(f"{fault}: the drill ended with {drill.returncode} before the next step: {said}")
        return any(ln["pid"] != victim for ln in _lines(logs) if ln["t"] > _last(logs, victim))

    wait_until("the next step", next_step, wait_s, 0.05)
    phases.end(f"{fault}: the fault and the next step")
    if drill is not None:
        try:
            drill.wait(wait_s)
        except subprocess.TimeoutExpired:
            drill.kill()
        phases.end(f"{fault}: the drill's own end")
    if fault != "kill":  # the drill's start: its first step sends the signal (else: the rank's last step before it)
        at = _drill_started(verdict_path) or _last(logs, victim)
    lines = _lines(logs)
    after = min((ln for ln in lines if ln["pid"] != victim and ln["t"] > at), key=lambda ln: ln["t"])
    last = max(ln["step"] for ln in lines if ln["pid"] == victim)
    return {
        "fault": fault,
        "victim": victim,
        "fault_t": at,
        "next_step_s": round(after["t"] - at, 2),
        "steps_redone": last - (after["step"] - 1),
        "waited_as_spare_s": after.get("spare_warm_s"),
        "join_parts": after.get("join_parts"),  # the replacement's join: rendezvous, group, state (s)
    }


def _drill_started(verdict: Path) -> float | None:
    """The drill's own start (`started` in its --json verdict), None when it wrote none."""
    try:
        started = json.loads(verdict.read_text()).get("started")
    except (OSError, ValueError, AttributeError):
        return None
    return float(started) if isinstance(started, (int, float)) else None


def _snapshot_budgets(logs: Path) -> dict[int, Any]:
    """Each rank process's host snapshots as set up: mode, staging bytes, budget and why (the loop logs them)."""
    return {ln["pid"]: ln["snapshot"] for ln in _lines(logs) if ln.get("snapshot")}


def _listed(daemon: DaemonProcess, pid: int) -> bool:
    trainers = daemon.get("/v1/gpus/0").get("trainers") or []
    return any(t.get("pid") == pid for t in trainers)


def _last(logs: Path, pid: int) -> float:
    return max((ln["t"] for ln in _lines(logs) if ln["pid"] == pid), default=0.0)


def _own_snapshot_committed(logs: Path) -> bool:
    """Whether the live rank (the newest step's) committed a host snapshot of its own (the loop's `committed`)."""
    lines = _lines(logs)
    return bool(lines) and max(lines, key=lambda ln: ln["t"]).get("committed") is not None


def _lines(logs: Path) -> list[dict[str, Any]]:
    found = []
    for path in logs.glob("steps.*.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return found


def _table(rows: list[dict[str, Any]], faults: list[str]) -> str:
    names = {"kill": "kill -9", "xid": "own XID 31", "stop": "SIGSTOP"}
    out = [
        "| state | spare | "
        + " | ".join(names[f] for f in faults)
        + " | cold start to its first step | set-up | the waiting spare holds (host, GPU) |",
        "| --- | --- | " + " | ".join("---" for _ in faults) + " | --- | --- | --- |",
    ]
    for row in rows:
        by = {f["fault"]: f for f in row["faults"]}
        cells = [
            f"{by[f]['next_step_s']:.2f} s ({by[f]['steps_redone']} redone)" if f in by else row.get("error", "")[:40]
            for f in faults
        ]
        out.append(
            f"| {row['gib']:g} GiB | {row['kind']} | " + " | ".join(cells)
            + f" | {row.get('cold_start_s', '')} s | {row.get('setup_s', '')} s | {_memory(row)} |"
        )  # fmt: skip
    return "\n".join(out)


def _memory(row: dict[str, Any]) -> str:
    held = row.get("spare_memory") or {}
    return f"{held.get('host_rss_mib', '?')} MiB, {held.get('gpu_mib', '-')} MiB"


if __name__ == "__main__":
    sys.exit(main())
