"""The spare: start the interpreter, import torch (and create the CUDA context when told), then wait.

    python -m gpuwatch.spares.worker        # started by SparePool, never by hand

The launcher starts it with the job's environment minus the rank's own variables, a pipe on stdin
and the write end of a second pipe in $GPUWATCH_SPARE_READY_FD. Once warm it writes one byte there
(so the launcher knows it is warm), then reads one JSON line from stdin, the hand-over:
`{"argv": ["-m", "module", ...] or ["script.py", ...], "env": {...}}`. It takes that environment as
its own, points stdin at /dev/null and runs the job's module or script as `__main__` (runpy), as
`python [-m] SCRIPT ARGS` would; the job's exit is the process's exit. An empty stdin (the launcher
is gone, or it stops the spare) ends it with 0.

With $GPUWATCH_SPARE_CUDA=1 the spare creates its CUDA context on the one GPU of its
CUDA_VISIBLE_DEVICES before it says it is warm (and runs a small model's step there: cuBLAS and the
optimizer's kernels load once): the launcher then hands it only a rank of that GPU (a context cannot
move to another GPU, and CUDA_VISIBLE_DEVICES is read once, when CUDA starts). With
$GPUWATCH_SPARE_NOW=1 (a job's first ranks) it skips the warm-up and runs the order at once.

A standby ($GPUWATCH_SPARE_ARGV, the job's command as JSON) runs the job's command right after its
warm-up, with the rank's keys held back ($GPUWATCH_SPARE_HELD), and takes its hand-over where the
script joins the job (gpuwatch.trainer.standby): the job's set-up is done before the fault.

When the job ends by itself (returns, sys.exit, os._exit, an exception) the runner writes its exit
code to its second pipe, $GPUWATCH_SPARE_WORD_FD (`exit N`), before the process begins to exit: a rank whose exit begins
without that word was killed, and the launcher replaces it at once (gpuwatch.spares.pool).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from typing import NoReturn

from gpuwatch.spares.pool import CUDA_ENV, NOW_ENV, STANDBY_ARGV_ENV, WORD, WORD_FD_ENV
from gpuwatch.trainer.contract import SPARE_WARM_S_ENV
from gpuwatch.trainer.standby import HELD_ENV, READY_FD_ENV, arm, take_over

# What a rank of an in-place job imports besides torch: paid once, while nothing waits for it.
_PRELOAD = (
    "torch.distributed", "torch.nn.parallel", "torch.distributed.optim", "torch.distributed.checkpoint",
    "torch.distributed.fsdp", "torch._dynamo", "gpuwatch.inplace.job", "gpuwatch.inplace.sharded", "gpuwatch.snapshots",
    "gpuwatch.trainer",
)  # fmt: skip
PRELOAD_ENV = "GPUWATCH_SPARE_PRELOAD"  # more modules to import while waiting (the job's own), comma-separated


def main() -> int:
    """Warm up, say so, wait for the hand-over, run the job (its exit code is ours); with NOW_ENV, run it at once."""
    now = os.environ.pop(NOW_ENV, "") == "1"
    # `python -m` put the launch's working directory first on sys.path: a torch.py (or any module
    # the warm-up imports) that another user left in a shared directory would run as the job's user
    # before the job asked for anything. The job's own run puts its directory back (`_run`).
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]
    if not now:
        _warm_up(cuda=os.environ.get(CUDA_ENV) == "1")
    ready_fd, word_fd = _fd(READY_FD_ENV), _fd(WORD_FD_ENV)
    standby = json.loads(os.environ.pop(STANDBY_ARGV_ENV, "null"))
    held = [k for k in os.environ.pop(HELD_ENV, "").split(",") if k]
    if ready_fd is not None:
        if not now:
            _say(ready_fd, b"1")
        if standby and not now:
            os.set_inheritable(ready_fd, False)  # kept for the join's byte and the first step's (trainer.standby)
        else:
            os.close(ready_fd)
    if word_fd is not None:
        os.set_inheritable(word_fd, False)  # the job's own subprocesses never hold it
    if standby and not now:  # a standby: the job's own set-up now, its rank at the join
        os.environ.pop(CUDA_ENV, None)
        arm(held, ready_fd)
        return _run_and_say([str(a) for a in standby], word_fd)
    warm_at = time.monotonic()
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    argv, env = [str(a) for a in order["argv"]], {str(k): str(v) for k, v in order["env"].items()}
    if not now:  # a spare took the rank over (its report says so); a first rank was only run by the runner
        env[SPARE_WARM_S_ENV] = f"{time.monotonic() - warm_at:.3f}"
    env.pop(CUDA_ENV, None)
    take_over(env)
    return _run_and_say(argv, word_fd)


def _warm_up(*, cuda: bool) -> None:
    import importlib

    import torch

    extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    for name in (*_PRELOAD, *extra):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the job will import it itself (and fail there if it must)
            print(f"gpuwatch spare: cannot preload {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    # What a first optimizer step imports and sets up lazily (torch._dynamo's checks among it), on a dummy.
    dummy = torch.nn.Parameter(torch.zeros(4))
    dummy.sum().backward()
    torch.optim.Adam([dummy]).step()
    if cuda and torch.cuda.is_available():
        torch.cuda.init()
        # The context, the caching allocator, cuBLAS and the optimizer's kernels on its one GPU: a rank's
        # first step would load them.
        layer = torch.nn.Linear(8, 8, device="cuda")
        layer(torch.ones(2, 8, device="cuda")).sum().backward()
        torch.optim.Adam(layer.parameters()).step()
        torch.cuda.synchronize()


def _run_and_say(argv: list[str], word_fd: int | None) -> int:
    """Run the job; say its exit code on `word_fd` as it ends by itself (os._exit included)."""
    real_exit = os._exit

    def exit_now(code: int) -> NoReturn:
        _say(word_fd, WORD + b"%d\n" % _code(code))
        real_exit(code)

    os._exit = exit_now  # type: ignore[assignment]  # a job that ends with os._exit still says how
    code = 1  # an exception out of the job: Python exits 1
    try:
        code = _run(argv)
    except SystemExit as exc:
        code = _code(exc.code)
        raise
    finally:
        _say(word_fd, WORD + b"%d\n" % code)
    return code


def _code(value: object) -> int:
    """The exit status Python makes of sys.exit(value) / os._exit(value)."""
    if value is None:
        return 0
    return value & 0xFF if isinstance(value, int) else 1


def _fd(name: str) -> int | None:
    given = os.environ.pop(name, "")
    return int(given) if given.isdigit() else None


def _say(fd: int | None, data: bytes) -> None:
    if fd is not None:
        try:
            os.write(fd, data)
        except OSError:  # the launcher is gone
            pass


def _run(argv: list[str]) -> int:
    """`python [-m] SCRIPT ARGS` in this process: the job runs as __main__ and its SystemExit is ours."""
    if argv[0] in ("-m", "--module"):
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())  # as `python -m` does, now that the job runs (its own choice)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())  # the job's own SystemExit passes through unchanged
