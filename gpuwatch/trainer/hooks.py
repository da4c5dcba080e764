"""The trainer contract in hook form, for loops a framework owns (Hugging Face Trainer, Lightning, torchtitan).

`TrainerLink.rescue()` and the stop check in the README's loop need the user to own the loop.
A framework calls out through hooks instead: step begins, step ends, a checkpoint was saved. These
hooks give the same protection from those calls:

* `begin_step()` / `end_step(step, loss)`: the step's collectives run between them (the link aborts
  them, NCCL, when a stop waits too long); `end_step` reports the step and says whether every rank
  agreed to stop. The agreement is one MAX all-reduce of one number per step, started at
  `begin_step` and waited for at `end_step`, so it runs beside the step's own work.
* `failure(exc)`: what `rescue()` does with a failed step: a peer's death (a collective error, the
  term signal torchrun sends the survivors) saves the last completed step alone (`save`, no
  collective call) and exits 75; the rank's own CUDA fault or any other error returns.
* `install_excepthook()`: frameworks with no exception hook (Hugging Face Trainer) let the error
  leave the user's script; `failure` then runs from `sys.excepthook`, where the model and optimizer
  still hold the last completed step.
* `exit_for_resume()`: after the framework's own save of the agreed stop.
* `begin_pause(reason)`: the framework's own work between two steps starts (a checkpoint save, an
  evaluation): the ranks that wait on a slow save in a barrier, and the one that writes to a slow
  disk, use no CPU time on their main thread, which the daemon's hang rule would take for a frozen
  rank. Declared (TrainerLink.pause), it is progress until the next step begins or the link closes.

Checkpoint directories the framework writes are sealed and verified by gpuwatch.trainer.sealed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, NoReturn

from gpuwatch.trainer.link import TrainerLink

log = logging.getLogger("gpuwatch.trainer")

RescueSave = Callable[[int], object]
FRAMEWORK_PAUSE_S = 1800.0  # the most a framework's save or evaluation may take before the hang limits run again


class TrainingHooks:
    """One rank's gpuwatch protection, driven by a framework's callbacks.

    Args:
        link: the rank's TrainerLink; default: a new one (its signal handlers chain to those in place).
        save: writes the checkpoint of the given step with no collective call (a survivor's save);
            None where the state has no replica on this rank (FSDP, tensor parallel): a peer's death
            then costs the steps since the framework's last checkpoint.
        agree_stop: run the per-step stop agreement (off for one-process jobs or a framework that
            agrees itself).
    """

    def __init__(self, link: TrainerLink | None = None, *, save: RescueSave | None = None, agree_stop: bool = True):
        self.link = link if link is not None else TrainerLink()
        self.save = save
        self.agree_stop = agree_stop
        self.stopping = False  # every rank agreed to stop: the framework's save comes next, then exit_for_resume
        self._flag: Any = None
        self._flag_work: Any = None
        self._previous_excepthook: Callable[..., Any] | None = None
        self._pause: contextlib.ExitStack | None = None

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The step's collectives start now (a declared pause ends); send this rank's stop flag to the agreement."""
        self.end_pause()
        self.link._stop.block_entered_t = time.monotonic()
        dist = _initialized_dist()
        if self.agree_stop and dist is not None and dist.get_world_size() > 1:
            torch = sys.modules["torch"]
            device = f"cuda:{torch.cuda.current_device()}" if "nccl" in str(dist.get_backend()) else "cpu"
            self._flag = torch.tensor([1.0 if self.link.stop_requested else 0.0], device=device)
            self._flag_work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)

    def end_step(self, step: int, loss: float | None = None, grad_norm: float | None = None) -> bool:
        """Report that `step` finished; True when every rank agreed to stop at it (save, then `exit_for_resume`).

        After the term signal (torchrun tears the group down: a peer died) the state is the
        finished `step`: it is rescued at once (`failure`), and this call does not return.
        """
        if self.link._stop.terminated:  # the link would end the process by the signal: rescue this step instead
            self.link._stop.terminated = False
            self.link.step(step, loss, grad_norm)
            self.failure(RuntimeError(f"{_term_name(self.link)} arrived: the process group is being torn down"))
        self.link.step(step, loss, grad_norm)
        stop = self.link.stop_requested if self._flag_work is None else self._agreed()
        self.link._stop.block_entered_t = None
        if stop and not self.stopping:
            self.stopping = True
            log.warning("rank %s: every rank stops after step %d (%s)", self.link.rank, step, self._reason())
        return stop

    def finish_instead(self) -> None:
        """The agreed stop fell on the job's last step: the framework finishes there (exit 0), no exit 75."""
        if self.stopping:
            self.stopping = False
            log.warning("rank %s: the stop fell on the last step: the job finishes instead", self.link.rank)

    def _agreed(self) -> bool:
        work, self._flag_work = self._flag_work, None
        work.wait()
        return bool(self._flag.item() > 0)

    def _reason(self) -> str:
        return self.link.stop_reason or "a peer was asked to stop"

    # -- the framework's own work between steps ----------------------------------------------------

    def begin_pause(self, reason: str, up_to_s: float = FRAMEWORK_PAUSE_S) -> None:
        """Declare the framework's save or evaluation that starts now; it lasts until `end_pause`, the next
        `begin_step` or `close`, or `up_to_s` (the daemon bounds it by its trainer.max_pause_s too)."""
        if self._pause is None:
            pause = contextlib.ExitStack()
            pause.enter_context(self.link.pause(reason, up_to_s))
            self._pause = pause

    def end_pause(self) -> None:
        """End the declared pause, if one is on."""
        pause, self._pause = self._pause, None
        if pause is not None:
            pause.close()

    # -- failures -------------------------------------------------------------------------------

    def failure(self, exc: BaseException) -> None:
        """A step failed with `exc`: rescue and exit 75 when a peer's failure caused it; else return.

        An exit (SystemExit, our own `exit_for_resume` among them) or an interrupt is no failure.

        Raises:
            SystemExit: 75 after a rescue.
        """
        self.link._stop.block_entered_t = None
        if isinstance(exc, Exception):
            with _term_signal_held(self.link):
                self.link._rescue_or_return(exc, self.save)

    def install_excepthook(self) -> None:
        """Run `failure` on an error that leaves the program (a framework with no exception hook of its own)."""
        if self._previous_excepthook is None:
            self._previous_excepthook = sys.excepthook
            sys.excepthook = self._excepthook

    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        try:
            self.failure(exc)
        except SystemExit as done:  # rescued: leave now, as exit_for_resume would have from the loop
            _flush()
            os._exit(done.code if isinstance(done.code, int) else 1)
        except Exception:
            log.exception("rank %s: the rescue failed", self.link.rank)
        previous = self._previous_excepthook or sys.__excepthook__
        previous(kind, exc, tb)

    def exit_for_resume(self) -> NoReturn:
        """Leave with exit code 75 after the framework saved the agreed stop's checkpoint."""
        dist = _initialized_dist()
        if dist is not None:
            dist.destroy_process_group()
        self.link.exit_for_resume()

    def close(self) -> None:
        """End the link (finished) and put the previous excepthook back."""
        self.end_pause()
        if self._previous_excepthook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_excepthook
        self._previous_excepthook = None
        self.link.close()


@contextlib.contextmanager
def _term_signal_held(link: TrainerLink) -> Iterator[None]:
    """While a rescue saves, the term signal (torchrun's teardown) only waits: the framework's own handler
    would run a collective with the dead peer (Lightning broadcasts in its SIGTERM handler) and break the save.
    When the rescue does not exit, the handler is put back and a signal that arrived meanwhile is sent again."""
    signum = link._signals.term_signal
    if signum is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = signal.signal(signum, lambda number, _frame: arrived.append(number))
    leaving = False
    try:
        yield
    except SystemExit:
        leaving = True  # rescued: the process exits 75 now, the signal may keep waiting
        raise
    finally:
        if not leaving:
            signal.signal(signum, previous)
            if arrived:
                os.kill(os.getpid(), signum)


def _initialized_dist() -> Any:
    """torch.distributed when the program imported torch and initialized a process group, else None."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _term_name(link: TrainerLink) -> str:
    signum = link._signals.term_signal
    return signal.Signals(signum).name if signum is not None else "the term signal"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            continue
