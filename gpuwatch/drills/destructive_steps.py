"""Taking a GPU out of service for a reset or a PCIe re-plug, and bringing it back.

Order (docs/drills.md; why: docs/hardware-facts.md §Fault injection): quarantine through the API so
trainers checkpoint and leave; wait for them; refuse if any process is left (daemon and nvidia-smi
agree); ask the daemon to let go of its NVML handles (a reset fails while any client holds one); do the
deed; hand the handles back (always, even when the deed failed); see the GPU read again; after
`drills.burn_in_s` clean, release the quarantine the drill took.
"""

from __future__ import annotations

from gpuwatch.drills import injectors
from gpuwatch.drills.daemon_client import describe_trainers, gpu, pids, reacquire_backend, release_backend
from gpuwatch.drills.run_state import Run
from gpuwatch.drills.steps import Outcome, Pending, Skip, Step

DRILL_WINDOW_S = 600.0  # read errors while the handles are released count as the drill's, not as faults


def hands_off(run: Run) -> list[Step]:
    n, config = run.gpu, run.config
    drills, nvidia_smi = config.drills, config.tools.nvidia_smi

    def quarantine() -> Outcome:
        run.api.post(f"/v1/gpus/{n}/quarantine", {"reason": f"drill {run.kind.name}: the GPU is taken out"})
        return f"GPU {n} quarantined through the API; its trainers are asked to checkpoint and leave"

    def trainers_left() -> Outcome:
        if not run.trainers:
            return Skip(f"no trainer on GPU {n}")
        g = gpu(run.api, n)
        if not g.trainers:
            return f"the trainers left GPU {n} ({describe_trainers(run.before)})"
        return Pending(f"still on GPU {n}: {describe_trainers(g)}")

    def no_processes() -> Outcome:
        busy = sorted({*pids(gpu(run.api, n)), *injectors.compute_pids(nvidia_smi, run.uuid)})
        if not busy:
            return f"no process on GPU {n}, by the daemon and by {nvidia_smi}"
        return Pending(f"processes {busy} are on GPU {n}; it stays quarantined (`gpuwatch release {n}`)")

    def release_handles() -> Outcome:
        answer = release_backend(run.api, DRILL_WINDOW_S)
        run.handles_released = answer.released
        return answer.detail

    grace = config.trainer.grace_period_s + drills.detect_timeout_s
    return [
        Step("quarantine", f"quarantine GPU {n} through the API (reason 'drill {run.kind.name}')", quarantine),
        Step("trainers_left", f"wait up to {grace:g} s for the trainers on GPU {n} to leave", trainers_left, grace),
        Step(
            "no_processes",
            f"wait for no process on GPU {n} (daemon and `{nvidia_smi} --query-compute-apps`)",
            no_processes,
            config.interval_s + drills.detect_timeout_s,
        ),
        Step(
            "release_handles", "ask the daemon to release its NVML handles (POST /v1/backend/release)", release_handles
        ),
    ]


def reset(run: Run) -> list[Step]:
    nvidia_smi = run.config.tools.nvidia_smi

    def do_reset() -> Outcome:
        done = injectors.reset_gpu(nvidia_smi, run.gpu)
        run.back_since = run.clock.now()
        return done

    return [Step("reset", f"run {nvidia_smi} -r -i {run.gpu}", do_reset), reacquire(run)]


def pcie(run: Run) -> list[Step]:
    device, rescan = injectors.pci_paths(run.config.tools.sysfs_root, run.before.pci_bus_id)

    def do_rescan() -> Outcome:
        done = injectors.write_one(rescan)
        run.back_since = run.clock.now()
        return done

    def device_back() -> Outcome:
        return f"{device} is back" if device.exists() else Pending(f"{device} has not reappeared")

    return [
        Step("remove", f"write 1 to {device / 'remove'}", lambda: injectors.write_one(device / "remove")),
        Step("rescan", f"write 1 to {rescan}", do_rescan),
        Step("device_back", f"wait for {device} to reappear", device_back, run.config.drills.detect_timeout_s),
        reacquire(run),
    ]


def reacquire(run: Run) -> Step:
    """Runs even after a failed step: the daemon must never stay blind."""

    def check() -> Outcome:
        if not run.handles_released:
            return Skip("the daemon's handles were not released")
        answer = reacquire_backend(run.api)
        run.handles_released = False
        return answer.detail

    return Step("reacquire", "ask the daemon to open NVML again (POST /v1/backend/reacquire)", check, always=True)


def come_back(run: Run) -> list[Step]:
    n, drills = run.gpu, run.config.drills

    def gpu_back() -> Outcome:
        g = gpu(run.api, n)
        sampled_t, clock_mhz = (g.sample.t, g.sample.sm_clock_mhz) if g.sample else (0.0, None)
        if g.error is None and sampled_t >= run.back_since:
            return f"GPU {n} reads again: {g.state}, SM {clock_mhz} MHz"
        return Pending(f"GPU {n}: read error {g.error}, last sample {g.sample_age_s} s old")

    def burn_in() -> Outcome:
        g, now = gpu(run.api, n), run.clock.now()
        clean = g.state == "healthy" and g.error is None
        run.clean_since = (run.clean_since or now) if clean else None
        if run.clean_since is None:
            return Pending(f"GPU {n} is {g.state}")
        if now - run.clean_since < drills.burn_in_s:
            return Pending(f"GPU {n} clean for {now - run.clean_since:.0f} of {drills.burn_in_s:g} s")
        reason = f"drill {run.kind.name}: burn-in passed, {drills.burn_in_s:g} s clean"
        run.api.post(f"/v1/gpus/{n}/release", {"reason": reason})
        return f"released after {drills.burn_in_s:g} s clean"

    return [
        Step("gpu_back", f"wait for GPU {n} to read again", gpu_back, run.config.interval_s + drills.detect_timeout_s),
        Step(
            "released_after_burn_in",
            f"release GPU {n} once it has been healthy for drills.burn_in_s = {drills.burn_in_s:g} s",
            burn_in,
            drills.burn_in_s + drills.burn_in_timeout_s,
        ),
    ]
