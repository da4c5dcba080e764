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
stay null, so a trainer on another framework can use the link too (torchside.py).

TrainerLink ties its parts together, each with what it owns and its own locking rule: steprecord.py
(the steps and the pause, written by the training thread), stopping.py (the stop request and the
abort's timing), wakeup.py (the pipe and the signal handlers), channel.py (the report socket and the
step page). The link itself owns the thread, the report, and how the rank ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn

from gpuwatch.trainer.channel import ReportSender, ReportsUnreachable, StepPageWriter
from gpuwatch.trainer.contract import (
    DEFAULT_RUNTIME_DIR,
    ENDED_ERROR,
    ENDED_FINISHED,
    ENDED_RESUME,
    EXIT_RESUME,
    LAUNCH_DIR_ENV,
    RECOVERY_RELAUNCH,
    REPORT_SOCKET,
    REPORTS_REQUIRED_ENV,
    RUNTIME_DIR_ENV,
    SPARE_STAGE_ENV,
    SPARE_WARM_S_ENV,
    STATUS_FILE,
    TrainerReport,
    quarantined_in,
)
from gpuwatch.trainer.faults import Fault, classify, first_line
from gpuwatch.trainer.steprecord import StepRecord
from gpuwatch.trainer.stopping import StopState
from gpuwatch.trainer.torchside import abort_default_process_group, memory_stats, torch_cuda_device
from gpuwatch.trainer.torchside import gpu_uuid as gpu_uuid_of
from gpuwatch.trainer.wakeup import SignalPipe

log = logging.getLogger("gpuwatch.trainer")

FAULT_DRILL_SIGNAL = signal.SIGUSR2
"""What `gpuwatch drill --fault-rank` sends: with allow_drills, the rank raises a real XID 31 in its own context."""

_MAX_PAUSE_TEXT = 256
_PENDING_STOP_POLL_S = 0.1  # with a stop pending, how often the thread looks for a rescue() block to time


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
        self.allow_drills = allow_drills
        self.spare = SPARE_WARM_S_ENV in os.environ  # a warm spare took this rank over (gpuwatch.spares)
        self.spare_stage = os.environ.get(SPARE_STAGE_ENV) if self.spare else None  # standby or warm
        self.pid = os.getpid()
        self.rank = _env_int("RANK")
        self.local_rank = _env_int("LOCAL_RANK")
        self.world_size = _env_int("WORLD_SIZE")
        self.local_world_size = _env_int("LOCAL_WORLD_SIZE")
        self.job_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("GPUWATCH_JOB_ID") or None
        self._cuda_device = torch_cuda_device(self.local_rank or 0)
        self.gpu_uuid = gpu_uuid or gpu_uuid_of(self._cuda_device, self.local_rank or 0)
        self.last_loss: float | None = None
        self._stop = StopState(abort_after_s)
        self.recovery = RECOVERY_RELAUNCH  # an in-place engine that re-forms the job without a lost rank says so

        self._page = StepPageWriter(self.pid, os.environ.get(LAUNCH_DIR_ENV))
        self._steps = StepRecord(self._page)
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

        self._signals = SignalPipe(stop_signal, term_signal)
        handled = self._signals.stop_signals | ({FAULT_DRILL_SIGNAL} if allow_drills else set())
        self._signals.install(handled, self._on_signal)

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
        if self._stop.terminated:
            self._end_by_term_signal()
        if loss is not None:
            self.last_loss = loss
        if self._steps.record(step, grad_norm):
            self._signals.wake()

    @property
    def stop_requested(self) -> bool:
        """True once the stop signal arrived or status.json quarantined this rank's GPU; never resets."""
        return self._stop.requested

    @property
    def stop_reason(self) -> str | None:
        """Why the stop was requested (the first reason), else None."""
        return self._stop.reason

    @property
    def abort_after_s(self) -> float:
        """How long a pending stop waits on one `rescue()` block before the process group is aborted."""
        return self._stop.abort_after_s

    @property
    def last_step(self) -> int | None:
        """The last step passed to `step()` in this process (None before the first)."""
        return self._steps.step

    def request_stop(self, reason: str) -> None:
        """Set `stop_requested` (first reason wins); what the signal handlers and status.json check call."""
        self._stop.request(reason)

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
        self._stop.block_entered_t = time.monotonic()
        try:
            yield
        except Exception as exc:
            self._stop.block_entered_t = None
            self._rescue_or_return(exc, save)
            raise
        self._stop.block_entered_t = None
        if self._stop.aborted:  # the aborted collective returned instead of raising: the step is not done
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
        outer_reason, outer_until = self._steps.pause, self._steps.pause_until
        self._steps.set_pause(reason, time.time() + up_to_s)
        self._signals.wake()  # the reason goes out in a report now; the page already speaks
        try:
            yield
        finally:
            until = time.time()
            if outer_reason is not None and outer_until is not None and outer_until > until:
                until = outer_until  # a pause nested in a longer one: the outer goes on
            else:
                outer_reason = None
            self._steps.set_pause(outer_reason, until)
            self._signals.wake()

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
        self._signals.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.report_interval_s))
        self._send_report(final=True)  # the final one, after the thread is gone: no two senders
        self._sender.close()
        self._page.close()
        self._signals.restore(self._on_signal)
        self._signals.close()

    def _after_fork_in_child(self) -> None:
        """A forked child (a DataLoader worker) is not this rank: its signals must not reach our thread."""
        self._closed.set()
        self._signals.restore(self._on_signal, exactly=True)  # the forking thread is the child's main thread
        self._signals.close()
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
        if not (self._stop.aborted or self._stop.requested or fault is Fault.COLLECTIVE):
            return
        why = f"{type(exc).__name__}: {first_line(exc)}"
        if save is None:
            log.warning("rank %s: collective failed (%s); no rescue for this state", self.rank, why)
            return
        self._stop.rescuing = True
        step = self._steps.step
        if step is None:
            log.warning("rank %s: collective failed (%s) before any step: its checkpoint stands", self.rank, why)
        else:
            log.warning("rank %s: collective failed (%s): saving step %d alone", self.rank, why, step)
            save(step)
        self.exit_for_resume(f"rescued step {step} after {why}")

    def _check_abort(self) -> None:
        """Abort the default process group once a pending stop has waited too long on one rescue() block."""
        due = self._stop.abort_due()
        if due is None or time.monotonic() < due:
            return
        self._stop.aborted = True
        log.warning(
            "rank %s: stop pending (%s) and the step has not ended: aborting the process group",
            self.rank, self.stop_reason,
        )  # fmt: skip
        abort_default_process_group()

    def _end_by_term_signal(self) -> NoReturn:
        """The loop went on after the term signal: end the way that signal's default action would."""
        term_signal = self._signals.term_signal
        assert term_signal is not None
        name = signal.Signals(term_signal).name
        log.warning("rank %s: %s arrived and the loop went on: ending by %s", self.rank, name, name)
        signal.signal(term_signal, signal.SIG_DFL)
        os.kill(os.getpid(), term_signal)
        time.sleep(5)  # the default action ends the process before this returns
        os._exit(128 + term_signal)

    # -- signals (wakeup.py) -------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (main thread, at the next bytecode): set the flags, chain the previous one."""
        if signum in self._signals.stop_signals:
            self._note_stop_signal(signum)
        self._signals.chain(signum, frame)

    def _note_stop_signal(self, signum: int) -> None:
        self.request_stop(f"signal {signal.Signals(signum).name}")
        if signum == self._signals.term_signal:
            self._stop.term_signal_arrived(program_handles_it=callable(self._signals.previous.get(signum)))

    def _fault_drill(self) -> None:
        """FAULT_DRILL_SIGNAL with allow_drills: a real XID 31 in this rank's own CUDA context."""
        torch = sys.modules.get("torch")
        device = torch_cuda_device(self.local_rank or 0) if torch is not None else None
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
            due = self._stop.abort_due()
            if due is not None:
                timeout = min(timeout, max(0.0, due - time.monotonic()))
            elif self._stop.polling():
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
        signums = self._signals.wait(timeout)
        if signums is None:
            return False
        for signum in signums:
            if signum in self._signals.stop_signals:
                self._note_stop_signal(signum)
            elif signum == FAULT_DRILL_SIGNAL and self.allow_drills:
                self._fault_drill()
        return True

    def _check_status(self) -> None:
        """Re-read status.json when it changed, and request a stop when it quarantines our GPU."""
        if self.gpu_uuid is None or self._stop.requested:
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
        steps = self._steps
        return {
            "t": time.time(),
            "pid": self.pid,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "job_id": self.job_id,
            "gpu_uuid": self.gpu_uuid,
            "step": steps.step,
            "first_step": steps.first_step,
            "first_step_t": steps.first_step_t,
            "step_t": steps.step_wall_t,
            "step_time_s": steps.step_time_s(),
            "step_time_p99_s": steps.step_time_p99_s(),
            "grad_norm": steps.grad_norm(),
            "grad_norm_var": steps.grad_norm_var(),
            **memory_stats(None if self._ended else self._cuda_device),
            "stop_requested": self._stop.requested,
            "allow_drills": self.allow_drills,
            "spare": self.spare,
            "spare_stage": self.spare_stage,
            "recovery": self.recovery,
            "ended": self._ended,
            "pause": steps.pause,
            "pause_until": steps.pause_until,
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
