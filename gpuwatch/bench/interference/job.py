"""The job the monitors are measured beside: a step loop in a process of its own that times every step.

A step is `matmuls` square matmuls and, on a GPU, a synchronize, as a training step ends in one (the
next step's inputs depend on it): on an H200, 8 bf16 4096³ matmuls take about 1.65 ms (the short step,
where a monitor's cost shows most) and 240 about 50 ms (the long step). On the CPU (the sim form) the
matmuls are float32 256³ on one thread. The step time is the time between the ends of two steps, so
the Python of the loop and of launching the kernels counts, as it does in a training loop.

The parent drives it over stdin, one command a line, and reads one answer a line from stdout:

    use KIND SECONDS   switch to step KIND (short, long) and warm up that long: `ready <median step s>`
    start              time every step from the next one on
    stop PATH          stop timing, write the step times (float64 seconds) to PATH: `stopped <steps>`
    quit

A reader thread takes the commands, so the loop itself only looks at a queue between two steps.
"""

from __future__ import annotations

import argparse
import array
import collections
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpuwatch.bench.interference.child import Child, answer

# (matmuls, size) per device and kind
STEPS = {
    "cuda": {"short": (8, 4096), "long": (240, 4096)},
    "cpu": {"short": (8, 256), "long": (160, 256)},
}
ANSWER_TIMEOUT_S = 120.0  # the first `use` imports torch and initialises CUDA


def _step_function(device: str, kind: str) -> Callable[[], None]:
    import torch

    matmuls, size = STEPS[device][kind]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    matmul = torch.matmul
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> None:
        for _ in range(matmuls):
            matmul(a, b, out=out)
        sync()

    return step


def _loop(device: str) -> None:
    """The job: steps without end, timing them while asked to, until `quit`."""
    import torch

    torch.set_num_threads(1)
    commands: collections.deque[list[str]] = collections.deque()

    def read() -> None:
        for line in sys.stdin:
            commands.append(line.split())
        commands.append(["quit"])

    def idle() -> None:  # until the first `use`
        time.sleep(0.001)

    threading.Thread(target=read, name="commands", daemon=True).start()
    step: Callable[[], None] = idle
    timed = array.array("d")
    timing = False
    perf = time.perf_counter
    last = perf()
    while True:
        step()
        now = perf()
        if timing:
            timed.append(now - last)
        last = now
        if not commands:
            continue
        command = commands.popleft()
        if command[0] == "quit":
            return
        if command[0] == "use":
            step = _step_function(device, command[1])
            answer(f"ready {_warm_up(step, float(command[2]))!r}")
        elif command[0] == "start":
            timed, timing = array.array("d"), True
        elif command[0] == "stop":
            timing = False
            with open(command[1], "wb") as out:
                timed.tofile(out)
            answer(f"stopped {len(timed)}")
        last = perf()


def _warm_up(step: Callable[[], None], seconds: float) -> float:
    """Run steps for `seconds` (clocks and caches settle); the median of the last half."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while (start := time.perf_counter()) < end or len(times) < 4:
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[len(times) // 2 :])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=sorted(STEPS), required=True)
    parser.add_argument("--cpu", type=int, help="the CPU to pin the job to (before torch starts its threads)")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    _loop(args.device)


class JobProcess:
    """The parent's end: starts the job, switches its step, and times segments of it.

    Raises (from any method): RuntimeError naming the job's last stderr line when it exits or hangs.
    """

    def __init__(self, device: str, cpu: int | None, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.device = device
        self.workdir = workdir
        argv = [sys.executable, "-m", "gpuwatch.bench.interference.job", "--device", device]
        if cpu is not None:
            argv += ["--cpu", str(cpu)]
        self._child = Child("job", argv, workdir / "job.stderr", env)
        self._segments = 0

    @property
    def pid(self) -> int:
        return self._child.pid

    def use(self, kind: str, warm_up_s: float) -> float:
        """Switch to step `kind` and warm it up; its median step in seconds."""
        return float(self._ask(f"use {kind} {warm_up_s}", "ready", ANSWER_TIMEOUT_S + warm_up_s))

    def start(self) -> None:
        self._child.send("start")

    def stop(self) -> list[float]:
        """Stop timing; the step times (seconds) since start()."""
        self._segments += 1
        path = self.workdir / f"segment-{self._segments}.f64"
        steps = int(self._ask(f"stop {path}", "stopped", ANSWER_TIMEOUT_S))
        timed = array.array("d")
        with path.open("rb") as data:
            timed.fromfile(data, steps)
        path.unlink()
        return timed.tolist()

    def close(self) -> None:
        self._child.close()

    def _ask(self, line: str, answer: str, timeout_s: float) -> str:
        reply = self._child.ask(line, timeout_s)
        if not reply.startswith(answer + " "):
            raise RuntimeError(f"the job answered {reply!r} to {line.split()[0]}: {self._child.stderr_tail()}")
        return reply.split(" ", 1)[1].strip()

    def __enter__(self) -> JobProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


if __name__ == "__main__":
    main()
