"""The `validate` drill: take an idle GPU out, run the active GPU test on it, put it back only if it passes.

A scheduled check that a card in service still performs (the figures against its model's reference)
before a job finds out it does not. The target must be idle: no process and no trainer on it.
"""

from __future__ import annotations

from gpuwatch.drills.daemon_client import gpu, pids, release
from gpuwatch.drills.run_state import Run
from gpuwatch.drills.steps import Outcome, Pending, Step
from gpuwatch.errors import DaemonError


def steps(run: Run) -> list[Step]:
    n, config = run.gpu, run.config

    def quarantine() -> Outcome:
        run.api.post(f"/v1/gpus/{n}/quarantine", {"reason": "drill validate: the GPU test runs on it"})
        return f"GPU {n} quarantined through the API: no job is placed on it while the test runs"

    def no_processes() -> Outcome:
        busy = pids(gpu(run.api, n))
        return Pending(f"processes {busy} are on GPU {n}") if busy else f"no process on GPU {n}"

    def validate() -> Outcome:
        # 409 (the test failed: the GPU stays quarantined with a validation_failed finding) fails this step.
        body = {"reason": "drill validate: the GPU test passed", "validate": True}
        validation = release(run.api, n, body).validation
        if validation is None:
            raise DaemonError(f"POST /v1/gpus/{n}/release: the answer says nothing of the GPU test")
        return f"GPU test passed and GPU {n} is back in service: {validation.reason}"

    return [
        Step("quarantine", f"quarantine GPU {n} through the API (reason 'drill validate')", quarantine),
        Step("no_processes", f"wait for no process on GPU {n}", no_processes, config.interval_s),
        Step(
            "validate",
            f"POST /v1/gpus/{n}/release with validate: the GPU test (up to {config.validation.timeout_s:g} s) "
            "must pass against the model's reference",
            validate,
        ),
    ]
