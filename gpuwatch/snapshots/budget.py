"""The GPU memory a rank's snapshot staging may take by default, and why: the standby's room first.

The staging buffer (prepare.py) is taken from what is free after the first step, less a headroom for
the job's own growth. Under `gpuwatch launch --in-place` with standbys (gpuwatch.spares), the launcher
starts the next standby beside a rank only where the GPU's free memory is at least what that rank
holds (gpuwatch.spares.room): a staging buffer that took everything free left no standby after the
first hand-over, and the next fault got a spare without the job's set-up. So where the launcher says
it keeps standbys ($GPUWATCH_STANDBY_BESIDE, set for every rank and standby it starts), staging takes
only what leaves free, after it, what the rank then holds plus the headroom:

    free - S - headroom >= held + S   =>   S <= (free - headroom - held) / 2

`held` is everything in use on the GPU (total less free): the launcher's bound where NVML does not list
the rank, and never less than the rank's own figure (a job imports no NVML). A standby already waiting
beside the rank at its first step (the job's first ranks) counts there too, which only makes staging
smaller. A rank that replaced one whose process is still exiting ($GPUWATCH_GPU_FREEING, from the
launcher: that process and what NVML said it held) counts that memory as free while the process
exists: it is being freed, and counted in use it left a 16 GiB rank on an H200 no staging at all,
every later snapshot then going device-to-host before the update. An explicit gpu_budget wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from gpuwatch.base.procfs import ProcFs
from gpuwatch.trainer.contract import FREEING_ENV, STANDBY_BESIDE_ENV

STAGING_HEADROOM = 2 << 30
STAGING_HEADROOM_SHARE = 0.05

FreeBytes = Callable[[int], tuple[int, int]]  # device -> (free, total), as torch.cuda.mem_get_info


@dataclass(frozen=True)
class StagingBudget:
    """The most GPU memory staging may take (None: what is free less the headroom) and the reason, for stats()."""

    limit: int | None
    why: str


def headroom(total: int) -> int:
    """GPU memory staging leaves free for the job's own growth: the larger of 2 GiB and 5 % of the GPU."""
    return max(STAGING_HEADROOM, int(total * STAGING_HEADROOM_SHARE))


def staging_budget(
    given: int | None,
    device: int,
    *,
    environ: dict[str, str] | None = None,
    free_bytes: FreeBytes | None = None,
) -> StagingBudget:
    """The budget for staging on CUDA `device`: `given` (HostSnapshot's gpu_budget) when set, else the
    standby's room when the launcher keeps standbys beside the ranks, else none beyond the headroom."""
    if given is not None:
        return StagingBudget(given, "gpu_budget given")
    env = os.environ if environ is None else environ
    if env.get(STANDBY_BESIDE_ENV) != "1":
        return StagingBudget(None, "what is free less the headroom (no standby beside the rank)")
    free, total = (free_bytes or sys.modules["torch"].cuda.mem_get_info)(device)
    freeing = freeing_bytes(env.get(FREEING_ENV, ""), total - free)
    held, spare = total - free - freeing, headroom(total)
    limit = max(0, (free + freeing - spare - held) // 2)
    frees = f" + {_gib(freeing)} the replaced rank frees" if freeing else ""
    return StagingBudget(
        limit,
        f"leaves a standby's room: ({_gib(free)} free{frees} - {_gib(spare)} headroom - {_gib(held)} in use) / 2",
    )


def freeing_bytes(given: str, in_use: int) -> int:
    """What $GPUWATCH_GPU_FREEING ("<pid>:<bytes>") says is being freed: the bytes while that process exists and
    is no zombie (a zombie's memory is freed already), at most `in_use`; 0 for anything else."""
    pid, _, held = given.partition(":")
    if not (pid.isdigit() and held.isdigit()) or not ProcFs().alive(int(pid), None):
        return 0
    return min(int(held), max(0, in_use))


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
