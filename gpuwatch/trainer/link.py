"""TrainerLink: a rank's side of the runtime-directory contract (DESIGN.md, "Runtime directory").

The training loop calls `step()` once per step; it only appends to fixed-size deques, so it
costs about a microsecond and never touches a file, a lock or the GPU. A daemon thread does the
rest every `report_interval_s`: it writes `trainers/<pid>.json` (temp file + `os.replace`) and
re-reads `status.json` when its mtime changes, to learn that this rank's GPU was quarantined.
A stop request (the stop signal, or the quarantine seen in status.json) only sets a flag: the
loop polls `stop_requested` at a step boundary, agrees with the other ranks, saves a checkpoint
and calls `exit_for_resume()` (exit code 75, `EXIT_RESUME`).

torch is never imported here: when the program has imported it, it gives the GPU UUID and the
allocator stats; without it those fields come from CUDA_VISIBLE_DEVICES or stay null, so a
trainer on another framework can use the link too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

log = logging.getLogger("gpuwatch.trainer")

EXIT_RESUME = 75
"""Exit code of a rank that stopped on request and saved a checkpoint: relaunch and resume (EX_TEMPFAIL)."""

DEFAULT_RUNTIME_DIR = "/run/gpuwatch"
RUNTIME_DIR_ENV = "GPUWATCH_RUNTIME_DIR"

_STEP_TIME_WINDOW = 20
_GRAD_NORM_WINDOW = 100
_MEMORY_STAT_KEYS = {
    "reserved_bytes": "reserved_bytes.all.current",
    "allocated_bytes": "allocated_bytes.all.current",
    "inactive_split_bytes": "inactive_split_bytes.all.current",
    "num_alloc_retries": "num_alloc_retries",
    "num_ooms": "num_ooms",
}


class TrainerLink:
    """One training rank's connection to the node's gpuwatch daemon, through the runtime directory.

    Use it as a context manager (or call `close()`) so the rank's file is removed and the
    previous signal handler restored.

    Args:
        runtime_dir: the daemon's runtime directory; default $GPUWATCH_RUNTIME_DIR, else /run/gpuwatch.
        report_interval_s: how often the background thread writes the report and checks status.json.
        stop_signal: the signal that requests a stop (SIGUSR1, what the daemon sends); None installs
            no handler (the program handles signals itself).
        gpu_uuid: this rank's GPU ("GPU-…"); default: from torch when the program uses CUDA through
            it, else the CUDA_VISIBLE_DEVICES entry at LOCAL_RANK when that is a UUID list.

    Raises:
        ValueError: report_interval_s is not positive.
    """

    def __init__(
        self,
        runtime_dir: str | os.PathLike[str] | None = None,
        report_interval_s: float = 2.0,
        stop_signal: int | None = signal.SIGUSR1,
        gpu_uuid: str | None = None,
    ) -> None:
        if report_interval_s <= 0:
            raise ValueError(f"report_interval_s must be positive, not {report_interval_s}")
        self.runtime_dir = Path(runtime_dir or os.environ.get(RUNTIME_DIR_ENV) or DEFAULT_RUNTIME_DIR)
        self.report_interval_s = report_interval_s
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

        self._step: int | None = None
        self._last_step_t: float | None = None
        self._step_times: deque[float] = deque(maxlen=_STEP_TIME_WINDOW)
        self._grad_norms: deque[float] = deque(maxlen=_GRAD_NORM_WINDOW)

        self._report_path = self.runtime_dir / "trainers" / f"{self.pid}.json"
        self._status_key: tuple[int, int, int] | None = None
        self._write_failed = False
        self._closed = threading.Event()

        self._stop_signal = stop_signal
        self._previous_handler: Callable[[int, FrameType | None], Any] | int | None = None
        self._handler_installed = False
        if stop_signal is not None:
            self._install_handler(stop_signal)

        self._thread = threading.Thread(target=self._run, name="gpuwatch-trainer-link", daemon=True)
        self._thread.start()

    # -- the training loop's side ---------------------------------------------------------------

    def step(self, step: int, loss: float | None = None, grad_norm: float | None = None) -> None:
        """Record that `step` finished. No I/O and no lock: call it every step.

        Pass plain floats: a CUDA tensor would be kept alive, and reading it later forces a sync.

        Args:
            step: the step just finished.
            loss: its loss, kept as `last_loss`.
            grad_norm: its gradient norm; the report carries the variance of the last 100.
        """
        now = time.perf_counter()
        if self._last_step_t is not None:
            self._step_times.append(now - self._last_step_t)
        self._last_step_t = now
        self._step = step
        if loss is not None:
            self.last_loss = loss
        if grad_norm is not None:
            self._grad_norms.append(grad_norm)

    @property
    def stop_requested(self) -> bool:
        """True once the stop signal arrived or status.json quarantined this rank's GPU; never resets."""
        return self._stop_requested

    def request_stop(self, reason: str) -> None:
        """Set `stop_requested` (first reason wins); what the signal handler and status.json check call."""
        if not self._stop_requested:
            self.stop_reason = reason
            self._stop_requested = True

    def exit_for_resume(self) -> NoReturn:
        """Close the link and exit with EXIT_RESUME (75), after the caller saved its checkpoint.

        torchrun exits 1 whatever its workers' codes are, so this also writes torchelastic's error
        file ($TORCHELASTIC_ERROR_FILE, set by torchrun per worker): a launcher that sets
        TORCHELASTIC_ERROR_FILE for torchrun itself gets the root cause's file copied there, with
        `"errorCode": 75` added by torchrun.

        Raises:
            SystemExit: always, with code 75.
        """
        _write_elastic_error_file(f"gpuwatch: stopped for resume ({self.stop_reason or 'requested'})")
        self.close()
        raise SystemExit(EXIT_RESUME)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the thread, remove this rank's file and restore the previous signal handler. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, self.report_interval_s))
        try:
            self._report_path.unlink(missing_ok=True)
        except OSError as exc:
            log.debug("could not remove %s: %s", self._report_path, exc)
        self._restore_handler()

    def __enter__(self) -> TrainerLink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- signals --------------------------------------------------------------------------------

    def _install_handler(self, signum: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("TrainerLink created off the main thread: no handler for signal %d; status.json only", signum)
            return
        self._previous_handler = signal.getsignal(signum)
        signal.signal(signum, self._on_signal)
        self._handler_installed = True

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request_stop(f"signal {signal.Signals(signum).name}")
        previous = self._previous_handler
        if callable(previous):  # SIG_DFL and SIG_IGN are ints, not callables
            previous(signum, frame)

    def _restore_handler(self) -> None:
        if not self._handler_installed or self._stop_signal is None:
            return
        if threading.current_thread() is not threading.main_thread():
            log.debug("TrainerLink closed off the main thread: signal handler left in place")
            return
        if signal.getsignal(self._stop_signal) == self._on_signal:
            # None means a handler installed from C: it cannot be put back, so use the default.
            previous = self._previous_handler if self._previous_handler is not None else signal.SIG_DFL
            signal.signal(self._stop_signal, previous)
        self._handler_installed = False

    # -- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._check_status()
                self._write_report()
            except Exception:  # reporting must never stop; training goes on without it
                log.exception("gpuwatch trainer link: report failed")
            if self._closed.wait(self.report_interval_s):
                return

    def _check_status(self) -> None:
        """Re-read status.json when it changed, and request a stop when it quarantines our GPU."""
        if self.gpu_uuid is None or self._stop_requested:
            return
        path = self.runtime_dir / "status.json"
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
        for gpu in status.get("gpus", ()) if isinstance(status, dict) else ():
            if isinstance(gpu, dict) and gpu.get("uuid") == self.gpu_uuid and gpu.get("quarantined") is True:
                self.request_stop(f"gpuwatch quarantined {self.gpu_uuid}")
                return

    def report(self) -> dict[str, Any]:
        """The `trainers/<pid>.json` payload as of now (the contract's flat fields)."""
        step_times = self._step_times.copy()  # deque.copy is one C call: atomic under the GIL
        grad_norms = [g for g in self._grad_norms.copy() if math.isfinite(g)]
        payload: dict[str, Any] = {
            "t": time.time(),
            "pid": self.pid,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "job_id": self.job_id,
            "gpu_uuid": self.gpu_uuid,
            "step": self._step,
            "step_time_s": statistics.fmean(step_times) if step_times else None,
            "grad_norm": _finite(self._grad_norms[-1]) if self._grad_norms else None,
            "grad_norm_var": statistics.pvariance(grad_norms) if grad_norms else None,
        }
        payload.update(self._memory_stats())
        payload["stop_requested"] = self._stop_requested
        return payload

    def _memory_stats(self) -> dict[str, int | None]:
        """The caching allocator's counters for our device; all null without torch or before CUDA is up."""
        torch = sys.modules.get("torch")
        stats: dict[str, Any] = {}
        if torch is not None and self._cuda_device is not None and torch.cuda.is_initialized():
            try:
                stats = torch.cuda.memory_stats(self._cuda_device)
            except RuntimeError as exc:
                log.debug("torch.cuda.memory_stats failed: %s", exc)
        return {field: stats.get(key) if stats else None for field, key in _MEMORY_STAT_KEYS.items()}

    def _write_report(self) -> None:
        data = json.dumps(self.report(), allow_nan=False).encode()
        tmp = self._report_path.with_name(f"{self.pid}.json.tmp")
        try:
            self._report_path.parent.mkdir(exist_ok=True)  # trainers/ only: the daemon owns the runtime dir
            tmp.write_bytes(data)
            os.replace(tmp, self._report_path)
        except OSError as exc:
            # Common without a daemon (no runtime dir): say it once, keep trying quietly.
            (log.debug if self._write_failed else log.warning)("gpuwatch trainer report not written: %s", exc)
            self._write_failed = True
            return
        if self._write_failed:
            log.info("gpuwatch trainer report written to %s", self._report_path)
            self._write_failed = False


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


def _finite(value: float) -> float | None:
    """Strict JSON has no NaN or Infinity: write those as null."""
    return value if math.isfinite(value) else None


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
