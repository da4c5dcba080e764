"""When a rank that vanished died: the daemon sees a death only once the kernel has torn the process down.

A rank holding many GiB of pinned host memory and a CUDA context takes the kernel a second or more to
tear down after a SIGKILL, and the daemon's exit watch fires only at its end. Counted from then, an
incident's `time_to_resume_s` would be short by that teardown against the job's own log. The rank's step
page says when its last step ended and its reports how long a step takes: alive, it would have finished
the next step by then, so the death is dated no later than that end (nor later than its detection).
"""

from __future__ import annotations

from gpuwatch.model import TrainerInfo


def death_onset(info: TrainerInfo, seen_t: float) -> float:
    """The Unix time a rank (its last report and step page: `info`) died, seen gone at `seen_t`: the end of
    the step it never finished (its last step's end plus its p99, else mean, step time), or `seen_t` when
    that is later or unknown (no step yet, no step time)."""
    last, step = info.step_t, info.step_time_p99_s or info.step_time_s
    if last is None or not step or step <= 0 or last > seen_t:
        return seen_t
    return min(seen_t, last + step)
