"""The GPU test before release: a burned-in GPU (or one an operator releases) goes back only if it passes.

The test takes minutes, so it never runs under the monitor's lock: a burned-in GPU's runs in a thread
of its own, an operator's in the caller's thread. One test per GPU at a time; a test refused (processes
on the GPU) is tried again VALIDATION_RETRY_S later. What a result does to the GPU is the monitor's.

Locking: its bookkeeping (which GPU is under test, when to try again) is read and changed only under
the lock it is given, the monitor's; the validator itself runs outside it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager

from gpuwatch.model import GpuStatic
from gpuwatch.validation import ValidationResult

Validator = Callable[[GpuStatic, Sequence[int]], ValidationResult]
VALIDATION_RETRY_S = 60.0  # a validation refused (processes on the GPU) is tried again this much later

log = logging.getLogger("gpuwatch.monitor")


class ReleaseGate:
    """Runs the validator on a GPU at most once at a time, and again later when it was refused."""

    def __init__(
        self,
        lock: AbstractContextManager[object],
        statics: Mapping[int, GpuStatic],
        pids: Callable[[int], Sequence[int]],
        clock: Callable[[], float],
    ) -> None:
        self.lock = lock
        self.statics = statics
        self.pids = pids  # the processes last seen on a GPU: the validator refuses to run beside any
        self.clock = clock
        # The active test a burned-in GPU passes before release (daemon.py sets it on live backends).
        self.validator: Validator | None = None
        self._validating: dict[int, threading.Thread] = {}
        self._validate_after: dict[int, float] = {}

    def claim(self, index: int) -> ValidationResult | None:
        """Claim GPU `index` for a test in this thread; the refusal when there is no test or one is running."""
        if self.validator is None:
            return ValidationResult("refused", "no GPU test on this backend")
        with self.lock:
            if index in self._validating:
                return ValidationResult("refused", "a validation is running")
            self._validating[index] = threading.current_thread()
        return None

    def done(self, index: int) -> None:
        """The test of GPU `index` ended (under the lock)."""
        self._validating.pop(index, None)

    def start(self, index: int, now: float, on_result: Callable[[int, ValidationResult, float], None]) -> None:
        """Test a burned-in GPU in a thread, unless it is under test or waits for a retry (under the lock).

        `on_result(index, result, now)` runs under the lock for a result other than a refusal.
        """
        if index in self._validating or self._validate_after.get(index, 0.0) > now:
            return
        log.info("GPU %d burned in: running the GPU test before release", index)
        thread = threading.Thread(
            target=self._in_thread, args=(index, on_result), name=f"gpuwatch-validate-{index}", daemon=True
        )
        self._validating[index] = thread
        thread.start()

    def _in_thread(self, index: int, on_result: Callable[[int, ValidationResult, float], None]) -> None:
        result = self.run(index)
        with self.lock:
            self.done(index)
            now = self.clock()
            if result.outcome == "refused":
                log.warning("GPU %d: validation %s; trying again in %g s", index, result.reason, VALIDATION_RETRY_S)
                self._validate_after[index] = now + VALIDATION_RETRY_S
            else:
                on_result(index, result, now)

    def run(self, index: int) -> ValidationResult:
        """The validator on GPU `index`, given the processes NVML last listed on it (it refuses any)."""
        assert self.validator is not None
        try:
            return self.validator(self.statics[index], self.pids(index))
        except Exception as exc:  # a bug in the gate must keep the GPU out, not crash a thread silently
            log.exception("GPU %d: validation failed to run", index)
            return ValidationResult("failed", f"validation could not run: {type(exc).__name__}: {exc}")
