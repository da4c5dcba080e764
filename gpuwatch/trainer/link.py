"""TrainerLink: a rank's side of the trainer contract (gpuwatch.trainer.contract).

The training loop calls `step()` once per step; it appends to fixed-size deques and rewrites the
rank's step page in memory (gpuwatch.trainer.channel), so it costs about a microsecond and never
makes a syscall, takes a lock or touches the GPU (its first call writes one byte to the link's own
pipe, so the first report goes out at once). A daemon thread does the rest: it sends the report to
the daemon's report socket every `report_interval_s`, re-reads `status.json` when its mtime
changes, and sends a final report with `ended` when the link closes.

Stop requests (the stop signal, SIGTERM, the quarantine seen in status.json) only set a flag: the
loop polls `stop_requested` at a step boundary, agrees with the other ranks, saves a checkpoint and
calls `exit_for_resume()` (exit code 75). A rank blocked inside a collective never reaches that
boundary (its peer died or hangs), and a Python signal handler only runs when the main thread
returns to bytecode, so signals also reach the daemon thread through `signal.set_wakeup_fd`: the C
handler writes the signal number into the link's pipe from whatever thread the kernel picked, and
the daemon thread, blocked in select() on the read end, sees it at once. When a stop is pending
and the main thread has stayed inside one `rescue()` block for `abort_after_s` (after SIGTERM: at
once), the link aborts the default process group (NCCL) so the blocked collective fails, and
`rescue()` saves the last completed step with no collective call and exits 75. gloo (torch 2.13) cannot be aborted: its
blocked collective ends at the process group's timeout, so a gloo job bounds that timeout itself.

torch is never imported here: when the program has imported it, it gives the GPU UUID, the
allocator stats and the process group; without it those fields come from CUDA_VISIBLE_DEVICES or
stay null, so a trainer on another framework can use the link too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import select
import signal
import statistics
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

from gpuwatch.trainer.channel import ReportSender, ReportsUnreachable, StepPageWriter
from gpuwatch.trainer.contract import (
    DEFAULT_RUNTIME_DIR,
    ENDED_ERROR,
    ENDED_FINISHED,
    ENDED_RESUME,
    EXIT_RESUME,
    FIRST_STEP_SLOT,
    FIRST_STEP_T_SLOT,
    LAUNCH_DIR_ENV,
    PAUSE_UNTIL_SLOT,
    RECOVERY_RELAUNCH,
    REPORT_SOCKET,
    REPORTS_REQUIRED_ENV,
    RUNTIME_DIR_ENV,
    SPARE_STAGE_ENV,
    SPARE_WARM_S_ENV,
    STATUS_FILE,
    STEP_SLOT,
    STEP_T_SLOT,
    AllocatorFigures,
    TrainerReport,
    quarantined_in,
)
from gpuwatch.trainer.faults import Fault, classify, first_line

log = logging.getLogger("gpuwatch.trainer")

FAULT_DRILL_SIGNAL = signal.SIGUSR2
"""What `gpuwatch drill --fault-rank` sends: with allow_drills, the rank raises a real XID 31 in its own context."""

_STEP_TIME_WINDOW = 100  # the p99 step time is over these; the mean over the last _MEAN_STEPS
_MEAN_STEPS = 20
_MAX_PAUSE_TEXT = 256
_GRAD_NORM_WINDOW = 100
_PENDING_STOP_POLL_S = 0.1  # with a stop pending, how often the thread looks for a rescue() block to time
_WAKE = 0  # the byte step() and close() write to the pipe; signal numbers are never 0


class TrainerLink:
    """One training rank's connection to the node's gpuwatch daemon, through the runtime directory.

    Use it as a context manager (or call `close()`): the rank's final report is written with how
    it ended, and the previous signal handlers are restored (a stop signal whose previous action
    was the default, which would end the process, is ignored from then on).

    Args:
        runtime_dir: the daemon's runtime directory; default $GPUWATCH_RUNTIME_DIR, else /run/gpuwatch.
        report_interval_s: how often the background thread writes the report and checks status.json.
        stop_signal: the signal that requests a stop (SIGUSR1, what the daemon sends); None installs
            no handler at all (the program handles signals itself; no rescue from a blocked collective).
        gpu_uuid: this rank's GPU ("GPU-…"); default: from torch when the program uses CUDA through
            it, else the CUDA_VISIBLE_DEVICES entry at LOCAL_RANK when that is a UUID list.
        term_signal: the signal that ends the rank (torchrun's teardown of the survivors, the daemon's
            grace period): a stop request too, so a rank blocked in a collective can still rescue its
            state; a loop that calls `step()` again after it is ended by it. None: left at its default.
        abort_after_s: how long a rank with a pending stop may stay inside one `rescue()` block before
            the link aborts the default process group (after the term signal: no wait). Keep it above
            a collective checkpoint save's time.
        allow_drills: accept `gpuwatch drill --fault-rank` (FAULT_DRILL_SIGNAL): raise a real, harmless
            XID 31 in this rank's CUDA context.

    Raises:
        ValueError: report_interval_s or abort_after_s is not positive.
    """

    def __init__(
        self,
        runtime_dir: str | os.PathLike[str] | None = None,
        report_interval_s: float = 2.0,
        stop_signal: int | None = signal.SIGUSR1,
        gpu_uuid: str | None = None,
        *,
        term_signal: int | None = signal.SIGTERM,
        abort_after_s: float = 5.0,
        allow_drills: bool = False,
    ) -> None:
        if report_interval_s <= 0:
            raise ValueError(f"report_interval_s must be positive, not {report_interval_s}")
        if abort_after_s <= 0:
            raise ValueError(f"abort_after_s must be positive, not {abort_after_s}")
        self.runtime_dir = Path(runtime_dir or os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
        self.report_interval_s = report_interval_s
        self.abort_after_s = abort_after_s
        self.allow_drills = allow_drills
        self.spare = SPARE_WARM_S_ENV in os.environ  # a warm spare took this rank over (gpuwatch.spares)
        self.spare_stage = os.environ.get(SPARE_STAGE_ENV) if self.spare else None  # standby or warm
        self.pid = os.getpid()
        self.rank = _env_int("RANK")
        self.local_rank = _env_int("LOCAL_RANK")
        self.world_size = _env_int("WORLD_SIZE")
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE")
        self.job_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("GPUWATCH_JOB_ID") or None
        self._cuda_device = _torch_cuda_device(self.local_rank or 0)
        self.gpu_uuid = gpu_uuid or _gpu_uuid(self._cuda_device, self.local_rank or 0)
        self.last_loss: float | None = None
        self.stop_reason: str | None = None
        self._stop_requested = False
        self._stop_t: float | None = None  # monotonic time of the first stop request
        self._terminated = False  # term_signal arrived and no handler of the program's own takes it
        self._term_t: float | None = None  # monotonic time of the term signal

        self._step: int | None = None
        self._first_step: int | None = None
        self._first_step_t: float | None = None
        self._step_wall_t: float | None = None
        self.recovery = RECOVERY_RELAUNCH  # an in-place engine that re-forms the job without a lost rank says so
        self._step_times: deque[float] = deque(maxlen=_STEP_TIME_WINDOW)
        self._grad_norms: deque[float] = deque(maxlen=_GRAD_NORM_WINDOW)
        self._pause: str | None = None  # the pause the loop is in (pause())
        self._pause_until: float | None = None

        self._block_entered_t: float | None = None  # monotonic; set while the main thread is inside rescue()
        self._aborted = False
        self._rescuing = False

        self._page = StepPageWriter(self.pid, os.environ.get(LAUNCH_DIR_ENV))
        self._page_ints, self._page_floats = self._page.ints, self._page.floats
        self._sender = ReportSender(self.runtime_dir / REPORT_SOCKET, self._page.fd)
        if os.environ.get(REPORTS_REQUIRED_ENV):  # under gpuwatch launch: the daemon must hear this rank
            try:
                self._sender.connect_or_raise()
            except ReportsUnreachable:
                self._page.close()
                raise
        self._status_key: tuple[int, int, int] | None = None
        self._closed = threading.Event()
        self._ended: str | None = None

        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._owns_wakeup_fd = False
        self._previous_handlers: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}
        if stop_signal is None:  # the program handles signals itself
            term_signal = None
        self._stop_signals = {s for s in (stop_signal, term_signal) if s is not None}
        self._term_signal = term_signal
        handled = self._stop_signals | ({FAULT_DRILL_SIGNAL} if allow_drills else set())
        self._install_handlers(handled)

        _LIVE_LINKS.add(self)
        self._thread = threading.Thread(target=self._run, name="gpuwatch-trainer-link", daemon=True)
        self._thread.start()

    # -- the training loop's side ---------------------------------------------------------------

    def step(self, step: int, loss: float | None = None, grad_norm: float | None = None) -> None:
        """Record that `step` finished. No I/O, no syscall and no lock: call it every step.

        Pass plain floats: a CUDA tensor would be kept alive, and reading it later forces a sync.
        The step page gets the step at once (the daemon and launch read it even after a SIGKILL);
        the first call also wakes the reporter (one byte to the link's pipe), so the daemon learns
        the first step, and a relaunch's resume point, at once.

        Args:
            step: the step just finished (1-based count: after the first step, 1).
            loss: its loss, kept as `last_loss`.
            grad_norm: its gradient norm; the report carries the variance of the last 100.
        """
        if self._terminated:
            self._end_by_term_signal()
        wall = time.time()
        if self._step_wall_t is not None:
            self._step_times.append(max(0.0, wall - self._step_wall_t))  # a clock stepped back counts as 0
        self._step_wall_t = wall
        self._page_ints[STEP_SLOT] = step
        self._page_floats[STEP_T_SLOT] = wall
        self._step = step
        if loss is not None:
            self.last_loss = loss
        if grad_norm is not None:
            self._grad_norms.append(grad_norm)
        if self._first_step is None:
            self._first_step = self._page_ints[FIRST_STEP_SLOT] = step
            self._first_step_t = self._page_floats[FIRST_STEP_T_SLOT] = wall
            self._wake()

    @property
    def stop_requested(self) -> bool:
        """True once the stop signal arrived or status.json quarantined this rank's GPU; never resets."""
        return self._stop_requested

    @property
    def last_step(self) -> int | None:
        """The last step passed to `step()` in this process (None before the first)."""
        return self._step

    def request_stop(self, reason: str) -> None:
        """Set `stop_requested` (first reason wins); what the signal handlers and status.json check call."""
        if not self._stop_requested:
            self.stop_reason = reason
            self._stop_t = time.monotonic()
            self._stop_requested = True

    @contextlib.contextmanager
    def rescue(self, save: Callable[[int], object] | None) -> Iterator[None]:
        """Wrap one step's collectives: when they fail because a peer died or hung, save and exit 75.

        Inside the block: the step's collectives and the compute between them, ending with a sync
        (e.g. `loss.item()`), but not the state update (`optimizer.step()`): so when the block fails,
        the model and optimizer still hold the last completed step (`last_step`), as they do on every
        surviving rank of a data-parallel (replicated) job. The block fails when one of its calls
        raises a collective error (a dead peer on gloo), or when a stop is pending and the block has
        not ended within `abort_after_s` (the link aborts the process group: NCCL). Then, unless the
        error is this rank's own CUDA fault (its state may be bad), `save(last_step)` writes the
        checkpoint with no collective call (`save_checkpoint(..., single_writer=True)`) and the rank
        exits 75; with no step completed in this process the checkpoint it resumed from stands.

        Args:
            save: writes the checkpoint of the given step with no collective call; None for state that
                has no replica here (sharded: FSDP, DCP): the rank still gets out promptly, and the
                error propagates (the job resumes from its newest periodic checkpoint).

        Raises:
            SystemExit: 75 after a rescue.
            Exception: the block's own error when it is no collective failure, a CUDA fault, or save is None.
        """
        self._block_entered_t = time.monotonic()
        try:
            yield
        except Exception as exc:
            self._block_entered_t = None
            self._rescue_or_return(exc, save)
            raise
        self._block_entered_t = None
        if self._aborted:  # the aborted collective returned instead of raising: the step is not done
            self._rescue_or_return(RuntimeError("the process group was aborted during the step"), save)
            raise RuntimeError("the process group was aborted during the step")

    @contextlib.contextmanager
    def pause(self, reason: str, up_to_s: float) -> Iterator[None]:
        """Declare a long pause between steps that the loop expects, so the daemon never takes it for a hang.

        Wrap what stops the steps for longer than a few of them: a blocking checkpoint save, an
        evaluation pass, torch.compile's first step, a barrier waiting for those on another rank. The
        step page says at once until when the pause may last (no report needed: it is written into
        the page), and when it ended; until then no hang is found on this rank's job on this node but
        a stopped process (state T), which no pause explains. Past `up_to_s` the pause counts as
        ended and the hang limits run from there.

        Args:
            reason: a few words for the daemon's view ("checkpoint", "eval", "compile").
            up_to_s: the most the pause may take, in seconds; give it room (a slow disk, a cold cache).

        Raises:
            ValueError: up_to_s is not a positive finite number, or reason is empty, too long or not printable.
        """
        if not (math.isfinite(up_to_s) and up_to_s > 0):
            raise ValueError(f"up_to_s must be a positive number of seconds, not {up_to_s}")
        if not reason or len(reason) > _MAX_PAUSE_TEXT or not reason.isprintable():
            raise ValueError(f"reason must be printable text of 1 to {_MAX_PAUSE_TEXT} characters, not {reason!r}")
        outer_reason, outer_until = self._pause, self._pause_until
        until = time.time() + up_to_s
        self._pause, self._pause_until = reason, until
        self._page_floats[PAUSE_UNTIL_SLOT] = until
        self._wake()  # the reason goes out in a report now; the page already speaks
        try:
            yield
        finally:
            until = time.time()
            if outer_reason is not None and outer_until is not None and outer_until > until:
                until = outer_until  # a pause nested in a longer one: the outer goes on
            else:
                outer_reason = None
            self._pause, self._pause_until = outer_reason, until
            self._page_floats[PAUSE_UNTIL_SLOT] = until
            self._wake()

    def exit_for_resume(self, reason: str | None = None) -> NoReturn:
        """Close the link and exit with EXIT_RESUME (75), after the caller saved its checkpoint.

        torchrun exits 1 whatever its workers' codes are, so this also writes torchelastic's error
        file ($TORCHELASTIC_ERROR_FILE, set by torchrun per worker): a launcher that sets
        TORCHELASTIC_ERROR_FILE for torchrun itself gets the root cause's file copied there, with
        `"errorCode": 75` added by torchrun.

        Args:
            reason: the message for the error file; default: the stop request's reason.

        Raises:
            SystemExit: always, with code 75.
        """
        _write_elastic_error_file(f"gpuwatch: stopped for resume ({reason or self.stop_reason or 'requested'})")
        self.close(ended=ENDED_RESUME)
        raise SystemExit(EXIT_RESUME)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self, ended: str = ENDED_FINISHED) -> None:
        """Stop the thread, leave the final report (`ended`), restore the signal handlers. Idempotent.

        Args:
            ended: how the rank ended, one of the contract's ENDED_* values.
        """
        if self._closed.is_set():
            return
        self._ended = ended
        self._closed.set()
        self._wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.report_interval_s))
        self._send_report(final=True)  # the final one, after the thread is gone: no two senders
        self._sender.close()
        self._page.close()
        self._restore_handlers()
        self._close_pipe()

    def _close_pipe(self) -> None:
        """Close the pipe, unless the C handler may still write to it (a number reused by another file)."""
        if self._owns_wakeup_fd:
            return
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) is not this rank: its signals must not reach our thread."""
        self._closed.set()
        self._restore_handlers(exactly=True)  # the forking thread is the child's main thread
        self._close_pipe()
        self._sender.close()  # the parent's connection stays open; the child only drops its copy

    def __enter__(self) -> TrainerLink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.close(ENDED_FINISHED)
        elif isinstance(exc, SystemExit) and exc.code == EXIT_RESUME:
            self.close(ENDED_RESUME)
        else:
            self.close(ENDED_ERROR)

    # -- rescue ---------------------------------------------------------------------------------

    def _rescue_or_return(self, exc: BaseException, save: Callable[[int], object] | None) -> None:
        """Save and exit 75 when `exc` is a peer's failure and the state is ours to save; else return."""
        fault = classify(exc)
        if fault is Fault.CUDA:
            log.error("rank %s: own CUDA fault, no rescue (its state may be bad): %s", self.rank, first_line(exc))
            return
        if not (self._aborted or self._stop_requested or fault is Fault.COLLECTIVE):
            return
        why = f"{type(exc).__name__}: {first_line(exc)}"
        if save is None:
            log.warning("rank %s: collective failed (%s); no rescue for this state", self.rank, why)
            return
        self._rescuing = True
        if self._step is None:
            log.warning("rank %s: collective failed (%s) before any step: its checkpoint stands", self.rank, why)
        else:
            log.warning("rank %s: collective failed (%s): saving step %d alone", self.rank, why, self._step)
            save(self._step)
        self.exit_for_resume(f"rescued step {self._step} after {why}")

    def _check_abort(self) -> None:
        """Abort the default process group once a pending stop has waited too long on one rescue() block."""
        due = self._abort_due()
        if due is None or time.monotonic() < due:
            return
        self._aborted = True
        log.warning(
            "rank %s: stop pending (%s) and the step has not ended: aborting the process group",
            self.rank, self.stop_reason,
        )  # fmt: skip
        _abort_default_process_group()

    def _abort_due(self) -> float | None:
        """When to abort: `abort_after_s` after the stop (or the block's start), at once after the term signal.

        The term signal means the group is being torn down (torchrun: a peer failed; the daemon: the
        grace period is over), so no step boundary is worth waiting for; the rescue is as good.
        """
        entered, stop_t = self._block_entered_t, self._stop_t
        if self._aborted or self._rescuing or entered is None or stop_t is None:
            return None
        if self._term_t is not None:
            return max(entered, self._term_t)
        return max(entered, stop_t) + self.abort_after_s

    def _end_by_term_signal(self) -> NoReturn:
        """The loop went on after the term signal: end the way that signal's default action would."""
        assert self._term_signal is not None
        name = signal.Signals(self._term_signal).name
        log.warning("rank %s: %s arrived and the loop went on: ending by %s", self.rank, name, name)
        signal.signal(self._term_signal, signal.SIG_DFL)
        os.kill(os.getpid(), self._term_signal)
        time.sleep(5)  # the default action ends the process before this returns
        os._exit(128 + self._term_signal)

    # -- signals --------------------------------------------------------------------------------

    def _install_handlers(self, signums: set[int]) -> None:
        if not signums:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("TrainerLink created off the main thread: no signal handlers; status.json only")
            return
        for signum in sorted(signums):
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)
        previous_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        if previous_fd == -1:
            self._owns_wakeup_fd = True
        else:  # asyncio or another library owns it: signals are then seen when the main thread runs Python
            signal.set_wakeup_fd(previous_fd)
            log.info("signal wakeup fd already in use: a rank blocked in a collective sees signals late")

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (main thread, at the next bytecode): set the flags, chain the previous one."""
        if signum in self._stop_signals:
            self._note_stop_signal(signum)
        if not self._owns_wakeup_fd:
            self._wake(signum)  # the C handler did not write it: hand it to the thread now
        previous = self._previous_handlers.get(signum)
        if callable(previous):  # SIG_DFL and SIG_IGN are ints, not callables
            previous(signum, frame)

    def _note_stop_signal(self, signum: int) -> None:
        self.request_stop(f"signal {signal.Signals(signum).name}")
        if signum == self._term_signal:
            self._term_t = self._term_t or time.monotonic()
            self._terminated = not callable(self._previous_handlers.get(signum))

    def _restore_handlers(self, *, exactly: bool = False) -> None:
        if not self._previous_handlers:
            return
        if threading.current_thread() is not threading.main_thread():
            log.debug("TrainerLink closed off the main thread: signal handlers left in place")
            return
        if self._owns_wakeup_fd:
            current = signal.set_wakeup_fd(-1)
            if current != self._wake_w:  # replaced after we set it: put the newer owner's back
                signal.set_wakeup_fd(current)
            self._owns_wakeup_fd = False
        for signum, previous in self._previous_handlers.items():
            if signal.getsignal(signum) != self._on_signal:
                continue
            # None means a handler installed from C: it cannot be put back, so use the default.
            previous = previous if previous is not None else signal.SIG_DFL
            stop_only = signum in self._stop_signals and signum != self._term_signal
            if stop_only and previous == signal.SIG_DFL and not exactly:
                # A late stop request (the daemon does not know the loop is over) must not kill the
                # process in its epilogue (an evaluation, an upload): SIGUSR1's default action would.
                previous = signal.SIG_IGN
            signal.signal(signum, previous)
        self._previous_handlers.clear()

    def _wake(self, byte: int = _WAKE) -> None:
        with contextlib.suppress(OSError):  # full (already awake) or closed
            os.write(self._wake_w, bytes([byte]))

    def _fault_drill(self) -> None:
        """FAULT_DRILL_SIGNAL with allow_drills: a real XID 31 in this rank's own CUDA context."""
        torch = sys.modules.get("torch")
        device = _torch_cuda_device(self.local_rank or 0) if torch is not None else None
        if device is None or torch is None or not torch.cuda.is_initialized():
            log.warning("fault drill: rank %s has no CUDA context in this process: nothing done", self.rank)
            return
        from gpuwatch.trainer.xid import torch_store

        log.warning("fault drill: rank %s raises XID 31 on cuda:%d (its CUDA context is lost)", self.rank, device)
        try:
            torch_store(device=device)()
        except Exception as exc:  # the intended outcome: the context is gone; the main thread fails next
            log.warning("fault drill: rank %s: the store faulted as intended: %s", self.rank, first_line(exc))
        else:
            log.error("fault drill: rank %s: the store did not fault", self.rank)

    # -- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        next_report = 0.0
        while not self._closed.is_set():
            timeout = max(0.0, next_report - time.monotonic())
            due = self._abort_due()
            if due is not None:
                timeout = min(timeout, max(0.0, due - time.monotonic()))
            elif self._stop_t is not None and not (self._aborted or self._rescuing):
                timeout = min(timeout, _PENDING_STOP_POLL_S)  # the main thread may enter a block at any time
            try:
                woken = self._wait(timeout)
                if self._closed.is_set():
                    return
                self._check_abort()
                if woken or time.monotonic() >= next_report:
                    self._check_status()
                    self._send_report()
                    next_report = time.monotonic() + self.report_interval_s
            except Exception:  # reporting must never stop; training goes on without it
                log.exception("gpuwatch trainer link: report failed")
                next_report = time.monotonic() + self.report_interval_s

    def _wait(self, timeout: float) -> bool:
        """Sleep until `timeout` or a byte in the pipe (a signal, the first step, close); True when woken."""
        ready, _, _ = select.select([self._wake_r], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self._wake_r, 256)
        except BlockingIOError:
            return False
        for signum in set(data) - {_WAKE}:
            if signum in self._stop_signals:
                self._note_stop_signal(signum)
            elif signum == FAULT_DRILL_SIGNAL and self.allow_drills:
                self._fault_drill()
        return True

    def _check_status(self) -> None:
        """Re-read status.json when it changed, and request a stop when it quarantines our GPU."""
        if self.gpu_uuid is None or self._stop_requested:
            return
        path = self.runtime_dir / STATUS_FILE
        try:
            st = path.stat()
            key = (st.st_mtime_ns, st.st_size, st.st_ino)
            if key == self._status_key:
                return
            self._status_key = key
            status = json.loads(path.read_bytes())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.debug("could not read %s: %s", path, exc)
            return
        if quarantined_in(status, self.gpu_uuid):
            self.request_stop(f"gpuwatch quarantined {self.gpu_uuid}")

    def report(self) -> TrainerReport:
        """The report as of now (what goes to the daemon's report socket)."""
        step_times = self._step_times.copy()  # deque.copy is one C call: atomic under the GIL
        grad_norms = [g for g in self._grad_norms.copy() if math.isfinite(g)]
        return {
            "t": time.time(),
            "pid": self.pid,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "job_id": self.job_id,
            "gpu_uuid": self.gpu_uuid,
            "step": self._step,
            "first_step": self._first_step,
            "first_step_t": self._first_step_t,
            "step_t": self._step_wall_t,
            "step_time_s": statistics.fmean(list(step_times)[-_MEAN_STEPS:]) if step_times else None,
            "step_time_p99_s": _p99(step_times),
            "grad_norm": _finite(self._grad_norms[-1]) if self._grad_norms else None,
            "grad_norm_var": statistics.pvariance(grad_norms) if grad_norms else None,
            **self._memory_stats(),
            "stop_requested": self._stop_requested,
            "allow_drills": self.allow_drills,
            "spare": self.spare,
            "spare_stage": self.spare_stage,
            "recovery": self.recovery,
            "ended": self._ended,
            "pause": self._pause,
            "pause_until": self._pause_until,
        }

    def _memory_stats(self) -> AllocatorFigures:
        """The caching allocator's counters for our device; all null without torch or before CUDA is up."""
        torch = sys.modules.get("torch")
        stats: dict[str, Any] = {}
        if torch is not None and self._cuda_device is not None and torch.cuda.is_initialized() and not self._ended:
            try:
                stats = torch.cuda.memory_stats(self._cuda_device)
            except RuntimeError as exc:
                log.debug("torch.cuda.memory_stats failed: %s", exc)
        return {
            "reserved_bytes": stats.get("reserved_bytes.all.current"),
            "allocated_bytes": stats.get("allocated_bytes.all.current"),
            "inactive_split_bytes": stats.get("inactive_split_bytes.all.current"),
            "num_alloc_retries": stats.get("num_alloc_retries"),
            "num_ooms": stats.get("num_ooms"),
        }

    def _send_report(self, final: bool = False) -> None:
        """One report to the daemon; a daemon that is down, restarting or behind only costs this report."""
        self._sender.send(json.dumps(self.report(), allow_nan=False).encode(), final=final)


_LIVE_LINKS: weakref.WeakSet[TrainerLink] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for link in list(_LIVE_LINKS):
        if not link._closed.is_set():
            link._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def bench_step(n: int = 100_000) -> float:
    """Seconds per `TrainerLink.step()` call, averaged over `n` calls (for `gpuwatch bench`).

    Args:
        n: how many calls to time.

    Raises:
        ValueError: n is not positive.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, not {n}")
    with tempfile.TemporaryDirectory(prefix="gpuwatch-bench-") as runtime_dir:
        with TrainerLink(runtime_dir, report_interval_s=3600.0, stop_signal=None, gpu_uuid="GPU-bench") as link:
            step = link.step
            start = time.perf_counter()
            for i in range(n):
                step(i, 1.0, 0.5)
            return (time.perf_counter() - start) / n


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    try:
        return int(value) if value is not None else None
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, value)
        return None


def _p99(values: deque[float]) -> float | None:
    """The nearest-rank 99th percentile (of 100 step times: the second largest), None without any."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _finite(value: float) -> float | None:
    """Strict JSON has no NaN or Infinity: write those as null."""
    return value if math.isfinite(value) else None


def _abort_default_process_group() -> None:
    """Make the main thread's blocked collective fail: NCCL can be aborted from another thread; gloo cannot."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if torch is None or dist is None or not dist.is_available() or not dist.is_initialized():
        log.warning("no process group to abort")
        return
    backend = str(dist.get_backend())
    if "nccl" not in backend:
        log.warning(
            "%s process groups cannot be aborted (torch %s): the blocked collective ends at the process "
            "group's timeout (init_process_group(timeout=...))",
            backend, torch.__version__,
        )  # fmt: skip
        return
    try:
        dist.distributed_c10d._abort_process_group()
    except Exception as exc:  # best effort: the watchdog's timeout remains
        log.error("aborting the %s process group failed: %s", backend, exc)


def _torch_cuda_device(local_rank: int) -> int | None:
    """This rank's CUDA device index when the program imported torch and CUDA is there, else None.

    LOCAL_RANK when that many devices are visible (the torchrun convention), else the current
    device (one device per worker, as with --virtual-local-rank or a CUDA_VISIBLE_DEVICES shim).
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    device = local_rank if local_rank < torch.cuda.device_count() else torch.cuda.current_device()
    return int(device)


def _gpu_uuid(cuda_device: int | None, local_rank: int) -> str | None:
    """The UUID of this rank's GPU as NVML spells it ("GPU-…"), from torch or CUDA_VISIBLE_DEVICES."""
    torch = sys.modules.get("torch")
    if torch is not None and cuda_device is not None:
        try:
            uuid = str(torch.cuda.get_device_properties(cuda_device).uuid)
        except (RuntimeError, AttributeError) as exc:
            log.debug("no GPU uuid from torch: %s", exc)
        else:
            return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if not entries or not all(e.startswith("GPU-") for e in entries):
        return None
    if len(entries) == 1:  # one GPU per worker: whatever LOCAL_RANK is, that one is ours
        return entries[0]
    return entries[local_rank] if local_rank < len(entries) else None


def _write_elastic_error_file(message: str) -> None:
    """Leave torchelastic's per-worker error file so torchrun's summary and its own error file name why."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError as exc:
        log.debug("could not write %s: %s", path, exc)
