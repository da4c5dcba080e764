"""The standby's side of the join: a spare that ran the job's own set-up waits here for its rank.

A standby is a spare (gpuwatch.spares) that runs the job's command as soon as it starts, with the
environment a rank of its GPU gets minus the keys named in $GPUWATCH_SPARE_HELD (RANK, WORLD_SIZE, the
member id: only the hand-over gives them). The script builds its model, optimizer and data as usual;
where it joins the job (`InPlaceJob(...)` and `ShardedJob(...)` call `wait_for_rank` first;
`TrainerLink()` reads the held-back RANK, which waits the same way) the standby runs what the job
side registered with `before_waiting` (the restore's pinned host buffers: gpuwatch.inplace.sharded),
then tells the launcher it is ready (on its ready pipe: `j` when the set-up made a CUDA context,
which binds it to its GPU, `a` when it did not, so it may take a rank of any GPU) and blocks on stdin
for the hand-over, one JSON line `{"argv": [...], "env": {...}}`. It then takes the rank's
environment and the script goes on: the job object connects, forms the groups and takes the state.
Before that the process holds no rank, no store connection and no process group.

A script that reads a held-back key before the join (`os.environ["RANK"]`) waits at that read
instead, with one line saying where: the rest of its set-up then runs at the hand-over, as it did
without a standby. An empty stdin (the launcher stops the standby) ends the process with 0.

Only the standard library and the trainer's contract here: the job side and the spare's runner import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuwatch.trainer.contract import SPARE_WARM_S_ENV

HELD_ENV = "GPUWATCH_SPARE_HELD"  # the keys a standby gets only at the hand-over, comma-separated
READY_FD_ENV = "GPUWATCH_SPARE_READY_FD"  # the pipe a spare says its stages on ("1" warm, "j" at the join)
AT_JOIN = b"j"  # at the join, its CUDA context made (bound to its GPU)
AT_JOIN_ANY_GPU = b"a"  # at the join without a CUDA context: it may take a rank of any GPU
STEPPED = b"s"  # the rank it became finished a step: the launcher starts the next spare only now

_real_exit = os._exit  # the runner wraps os._exit to say the job's exit code; a stopped standby was no job
_lock = threading.Lock()
_PLUMBING = ("os", "_collections_abc", "collections.abc", __name__)  # frames between a script and its read
_state: dict[str, Any] = {}  # armed: held keys, ready fd; handed: set once the rank's environment is in
_prepares: list[Callable[[], object]] = []  # run before a standby waits (before_waiting)


def arm(held: list[str], ready_fd: int | None) -> None:
    """Make this process a standby: reads of `held` keys wait for the hand-over; the job's join says it is ready."""
    _state.update(held=frozenset(held), ready_fd=ready_fd, original=os.environ)
    os.environ = _HeldBack(os.environ)  # noqa: B003  # the same variables, watched: nothing to clear


def is_standby() -> bool:
    """Whether this process is a standby still waiting for its rank."""
    return "held" in _state and "handed" not in _state


def before_waiting(prepare: Callable[[], object]) -> None:
    """Have a standby run `prepare` before it says it is ready and waits for its rank: what the join will need,
    made off the fault's path (the job side registers it as it is imported). A prepare that fails is said in one
    line and the standby waits as before."""
    _prepares.append(prepare)


def wait_for_rank() -> None:
    """The job's join: a standby waits here for its rank (see the module docstring); anything else returns at once."""
    with _lock:
        if not is_standby():
            return
        for prepare in _prepares:
            try:
                prepare()
            except Exception as exc:
                print(f"gpuwatch standby: {getattr(prepare, '__qualname__', prepare)} before the join failed:"
                      f" {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)  # fmt: skip
        _say_ready()
        line = sys.stdin.buffer.readline()
        if not line.strip():
            _real_exit(0)  # the launcher stopped the standby: it never was a rank
        order = json.loads(line)
        env = {str(k): str(v) for k, v in order["env"].items()}
        env[SPARE_WARM_S_ENV] = f"{time.monotonic() - _state['ready_at']:.3f}"
        os.environ = _state["original"]  # noqa: B003  # the same variables, no longer watched
        take_over(env)
        _state["handed"] = True


def take_over(env: dict[str, str]) -> None:
    """Become the rank: its environment, no terminal input (a worker started by the launcher has none either)."""
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _say_ready() -> None:
    _state["ready_at"] = time.monotonic()
    fd = _state.pop("ready_fd", None)
    if fd is not None:
        torch = sys.modules.get("torch")
        bound = torch is not None and torch.cuda.is_initialized()  # CUDA_VISIBLE_DEVICES was read: this GPU only
        try:
            _state["stepped_fd"] = os.dup(fd)  # the same pipe, for the rank's first step (first_step_done)
            os.write(fd, AT_JOIN if bound else AT_JOIN_ANY_GPU)
            os.close(fd)  # its own number closes at the join, as tools that watch a spare's fds expect
        except OSError:  # the launcher is gone: the hand-over's empty stdin ends this process
            pass


def first_step_done() -> None:
    """The rank finished a step (the step engine calls it after each): the first time, say so on the spare's pipe.

    The launcher starts the next spare only then, so that its set-up does not compete with this rank's restore
    for the host's CPU and memory and the GPU's memory."""
    fd = _state.pop("stepped_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.write(fd, STEPPED)
        with contextlib.suppress(OSError):
            os.close(fd)


def _reader() -> tuple[str, str]:
    """Where a held-back key was read: `file:line` and the module of the first frame outside os and this module."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_globals.get("__name__") in _PLUMBING:
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}", str(frame.f_globals.get("__name__", ""))


class _HeldBack(os._Environ[str]):
    """os.environ whose held-back keys wait for the hand-over when read (get, [], in: all go through here)."""

    def __init__(self, environ: Any) -> None:
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue)

    def __getitem__(self, key: str) -> str:
        if key in _state.get("held", ()) and is_standby():
            where, module = _reader()
            if not module.startswith("gpuwatch."):  # gpuwatch's own join points are where it waits anyway
                print(
                    f"gpuwatch standby: the job reads {key} before it joins the job ({where}): this standby waits"
                    " there for its rank, and the rest of the script's set-up runs at the hand-over; read the"
                    " rank from the job object after the join instead (docs/spares.md)",
                    file=sys.stderr,
                    flush=True,
                )
            wait_for_rank()
        return str(super().__getitem__(key))
