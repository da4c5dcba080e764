"""measure_in_place: what a rank's death costs an in-place job, and what a join costs, at a given state size.

    python -m gpuwatch.bench.recovery_in_place --gib 0.1 0.5 2 [--backend nccl] [--workdir DIR]

prints one JSON line per state size (the dict below).

For `gpuwatch bench --only recovery` (its in-place column). A job of `gpuwatch.examples.bench_worker`
ranks runs under the in-place supervisor (in this process, on a thread), with fake GPUs on the CPU
(3 gloo ranks) or this machine's GPUs (NCCL, one rank each). Once every rank has taken 5 steps, the
last rank is SIGKILLed; the figures come from the job's own step logs:

* fault_to_next_step_s: the SIGKILL to the survivors' first completed step in the smaller group;
* death_seen_s: the SIGKILL to the launcher's seeing the process gone (the kernel frees its memory first);
* steps_lost: the survivors' furthest step before the fault + 1 - the first step after it (0: none);
* rejoin_s: the replacement's process start to its first completed step (interpreter, torch, the
  rendezvous and the state it receives); join_pause_s: how long the survivors paused for that join
  (the new group and the broadcast of the whole state); join_moved_bytes: what the join moved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from gpuwatch.launcher.in_place import GpuView, InPlacePlan, Supervisor

_STEADY_STEPS = 5


def measure_in_place(
    state_bytes: int, workdir: Path, backend: str = "gloo", *, ranks: int | None = None, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Kill one rank of an in-place job holding `state_bytes` of state; the figures above, as a dict.

    Args:
        state_bytes: model + optimizer state per rank.
        workdir: where the step logs and the runtime dir go (made if missing).
        backend: "gloo" (CPU, fake GPUs) or "nccl" (this machine's GPUs).
        ranks: how many ranks (default: 3 on gloo, every GPU on nccl; at least 2).
        timeout_s: the most any phase may take.

    Raises:
        ValueError: a bad backend, fewer than 2 ranks, or a negative state size.
        TimeoutError: a phase did not happen within timeout_s (the job's stderr is in the log).
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be gloo or nccl, not {backend!r}")
    if state_bytes < 0:
        raise ValueError(f"state_bytes must not be negative, not {state_bytes}")
    gpus = _gpus(backend, ranks)
    if len(gpus) < 2:
        raise ValueError(f"an in-place measurement needs at least 2 ranks, not {len(gpus)}")
    logs = Path(workdir) / f"steps-{state_bytes}"
    logs.mkdir(parents=True, exist_ok=True)
    command = ("-m", "gpuwatch.examples.bench_worker", "--state-bytes", str(state_bytes), "--log-dir", str(logs))
    plan = InPlacePlan(
        job_id=f"bench-{uuid.uuid4().hex[:8]}",
        command=(*command, "--backend", backend),
        runtime_dir=str(Path(workdir) / "run"),
        max_restarts=1,
        daemon_poll_s=0.2,
    )
    said: list[tuple[float, str]] = []
    supervisor = Supervisor(plan, lambda: gpus, echo=lambda line: said.append((time.time(), line)))
    result: list[BaseException | int] = []
    thread = threading.Thread(target=lambda: result.append(_run(supervisor)), name="bench-in-place", daemon=True)
    thread.start()
    n = len(gpus)
    try:
        _wait(logs, timeout_s, thread, f"{n} ranks at step {_STEADY_STEPS}", lambda ls: _ranks_at(ls, _STEADY_STEPS, n))
        lines = _lines(logs)
        victim = max((ln for ln in lines if ln["world"] == n), key=lambda ln: ln["rank"])["pid"]
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        survivors = {ln["pid"] for ln in lines if ln["pid"] != victim}
        after = _wait(
            logs, timeout_s, thread, "the survivors' next step", lambda ls: _after(ls, killed, survivors, n - 1)
        )
        first = min(after, key=lambda ln: ln["t"])
        seen = next((t for t, line in said if "killed by SIGKILL" in line), None)
        before = max(ln["step"] for ln in _lines(logs) if ln["pid"] == first["pid"] and ln["t"] <= killed)
        joined = _wait(
            logs, timeout_s, thread, "the replacement's join", lambda ls: _joiner(ls, survivors | {victim}, n)
        )
        joiner_first = min(joined, key=lambda ln: ln["t"])
        pause = [
            ln["change"]["seconds"]
            for ln in _lines(logs)
            if ln["pid"] in survivors and ln.get("change") and ln["generation"] == joiner_first["generation"]
        ]
        steady = _step_time(_lines(logs), first["pid"], n - 1)
    finally:
        supervisor.stop()
        thread.join(timeout=60)
    return {
        "path": "in_place",
        "backend": backend,
        "ranks": n,
        "state_bytes": state_bytes,
        "fault_to_next_step_s": round(first["t"] - killed, 3),
        "death_seen_s": round(seen - killed, 3) if seen is not None else None,
        "steps_lost": before + 1 - first["step"],
        "rejoin_s": round(joiner_first["t"] - joiner_first["started"], 3),
        "join_pause_s": round(max(pause), 3) if pause else None,
        "join_moved_bytes": joiner_first["change"]["moved"],
        "step_time_s": steady,
    }


def _run(supervisor: Supervisor) -> BaseException | int:
    try:
        return supervisor.run()
    except BaseException as exc:  # handed to the waiting thread, which says so
        return exc


def _gpus(backend: str, ranks: int | None) -> list[GpuView]:
    if backend == "gloo":
        return [GpuView(i, f"GPU-bench-cpu-{i}", True, 0) for i in range(ranks or 3)]
    import torch

    found = [
        GpuView(i, _uuid(torch.cuda.get_device_properties(i).uuid), True, 0) for i in range(torch.cuda.device_count())
    ]
    return found[: ranks or len(found)]


def _uuid(value: object) -> str:
    text = str(value)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def _lines(logs: Path) -> list[dict[str, Any]]:
    found = []
    for path in logs.glob("steps.*.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return found


def _wait(logs: Path, timeout_s: float, thread: threading.Thread, what: str, check: Any) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found: list[dict[str, Any]] = check(_lines(logs))
        if found:
            return found
        if not thread.is_alive():
            raise TimeoutError(f"the in-place job ended while waiting for {what}")
        time.sleep(0.02)
    raise TimeoutError(f"not within {timeout_s:g} s: {what}")


def _ranks_at(lines: list[dict[str, Any]], step: int, world: int) -> list[dict[str, Any]]:
    at = [ln for ln in lines if ln["step"] == step and ln["world"] == world]
    return at if len({ln["pid"] for ln in at}) == world else []


def _after(lines: list[dict[str, Any]], t: float, pids: set[int], world: int) -> list[dict[str, Any]]:
    return [ln for ln in lines if ln["t"] > t and ln["pid"] in pids and ln["world"] == world]


def _joiner(lines: list[dict[str, Any]], old: set[int], world: int) -> list[dict[str, Any]]:
    return [ln for ln in lines if ln["pid"] not in old and ln["world"] == world and "started" in ln]


def _step_time(lines: list[dict[str, Any]], pid: int, world: int) -> float | None:
    """The median time between two consecutive steps of one rank at that world size (its sleep included)."""
    times = sorted(ln["t"] for ln in lines if ln["pid"] == pid and ln["world"] == world)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return round(statistics.median(gaps), 4) if gaps else None


def main(argv: list[str] | None = None) -> int:
    """Measure at each --gib state size; one JSON line each."""
    parser = argparse.ArgumentParser(
        prog="python -m gpuwatch.bench.recovery_in_place", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--gib", type=float, nargs="+", default=[0.1, 0.5, 2.0], help="state sizes (GiB)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--ranks", type=int, help="default: 3 on gloo, every GPU on nccl")
    parser.add_argument("--workdir", help="default: a temporary directory")
    args = parser.parse_args(argv)
    if any(not gib > 0 for gib in args.gib):
        parser.error("--gib sizes must be positive")
    with tempfile.TemporaryDirectory(prefix="gpuwatch-inplace-bench-") as tmp:
        for gib in args.gib:
            figures = measure_in_place(int(gib * (1 << 30)), Path(args.workdir or tmp), args.backend, ranks=args.ranks)
            print(json.dumps({"state_gib": gib, **figures}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
