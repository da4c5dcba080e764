"""When a rank that vanished died: the daemon sees a death only once the kernel has torn the process down.

A rank holding many GiB of pinned host memory and a CUDA context takes the kernel a second or more to
tear down after a SIGKILL, and the daemon's exit watch fires only at its end. Counted from then, an
incident's `time_to_resume_s` would be short by that teardown against the job's own log.

The launcher that started the rank (`gpuwatch launch --in-place`) sees its exit begin within
milliseconds and says when in an exit note (gpuwatch.reports.exit_notes; the board keeps it on the
rank's report as `exit_t`, taken from the rank's parent only): that time is the death's onset. Without
one (another launcher, a note not yet read), the rank's step page says when its last step ended and its
reports how long a step takes: alive, it would have finished the next step by then, so the death is dated
no later than that end (nor later than its detection). That guess errs by the step in flight: a slow one
(a checkpoint, an evaluation) dates the death too early. A note read after the incident opened still
corrects it (`launcher_onset`), as long as its job has not come back.
"""

from __future__ import annotations

import logging

from gpuwatch.model import TrainerInfo
from gpuwatch.remediation.incidents import Incident
from gpuwatch.reports import Report

log = logging.getLogger("gpuwatch.remediation")

EXIT_NOTE_LATE_S = 1.0  # an exit note may date the exit this much after the daemon saw the rank gone (clocks)


def death_onset(info: TrainerInfo, seen_t: float, exit_t: float | None = None) -> float:
    """The Unix time a rank (its last report and step page: `info`) died, seen gone at `seen_t`: `exit_t`, when
    its launcher said when its exit began (no later than `seen_t`); else the end of the step it never finished
    (its last step's end plus its p99, else mean, step time), or `seen_t` when that is later or unknown (no
    step yet, no step time)."""
    noted = _noted_onset(exit_t, seen_t)
    if noted is not None:
        return noted
    last, step = info.step_t, info.step_time_p99_s or info.step_time_s
    if last is None or not step or step <= 0 or last > seen_t:
        return seen_t
    return min(seen_t, last + step)


def launcher_onset(incident: Incident, reports: list[Report]) -> bool:
    """Date a rank's death (`rank_died`) by its launcher's exit note when the note came after the incident
    opened and the job has not come back yet; True when the onset changed."""
    if incident.kind != "rank_died" or incident.next_step_t is not None:
        return False
    dead = {t.rank.pid for t in incident.targets if t.ended in {"died", "raised"}}
    noted = [r.exit_t for r in reports if r.info.pid in dead and r.exit_t is not None]
    onset = _noted_onset(min(noted, default=None), incident.t)
    if onset is None or incident.began_t == onset:
        return False
    log.info("incident %d: rank death dated by its launcher %.3f s %s the guess", incident.id,
             abs(onset - incident.began), "after" if onset > incident.began else "before")  # fmt: skip
    incident.began_t = onset
    return True


def _noted_onset(exit_t: float | None, seen_t: float) -> float | None:
    """The death's onset by its launcher's exit note (no later than when it was seen gone), or None without a
    note or with one dated past `seen_t` by more than the clocks' slack."""
    if exit_t is None or exit_t > seen_t + EXIT_NOTE_LATE_S:
        return None
    return min(exit_t, seen_t)
