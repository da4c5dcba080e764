"""Scheduled drills: each `[[drills.schedule]]` entry is an APScheduler cron job on the daemon's scheduler.

Cron strings are crontab's five fields, in UTC. A run the daemon missed (down, suspended, busy) is
dropped, never replayed in a burst: `coalesce` folds missed runs into one and `misfire_grace_time`
drops that one when it is later than `drills.misfire_grace_s`. Before each run the guards look at
the node through the API and skip (logged, counted in gpuwatch_drill_skipped_total{drill,reason})
when the node is not in a state the drill allows. This is the one gpuwatch module besides
daemon.py that imports APScheduler.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.cron import CronTrigger

from gpuwatch.config import Config, DrillSchedule
from gpuwatch.drills.daemon_client import DrillApi, gpus, pids
from gpuwatch.drills.record import DrillRecord
from gpuwatch.drills.runner import DrillRefused, Request, prepare, run_drill
from gpuwatch.drills.spec import KINDS, parse_dcgm, parse_inject
from gpuwatch.drills.steps import Clock, Verdict
from gpuwatch.errors import ConfigError, GpuwatchError

if TYPE_CHECKING:  # pydantic loads with the first answer read, not with the daemon that imports the drills
    from gpuwatch.serving import wire

log = logging.getLogger("gpuwatch.drills")

IDLE, TRAINER = "idle", "trainer"
RANK_KINDS = ("kill_rank", "hang_rank", "fault_rank")  # drills whose target must have a trainer


@dataclass(frozen=True)
class Entry:
    """A validated schedule entry; `number` is its place in the config (-1: an on-demand run)."""

    number: int
    schedule: DrillSchedule
    trigger: CronTrigger | None


def entries(config: Config) -> list[Entry]:
    """Every `[[drills.schedule]]` entry, validated.

    Raises:
        ConfigError: naming the entry (`drills.schedule[2]`) and what is wrong with it.
    """
    found = []
    for number, schedule in enumerate(config.drills.schedule):
        where = f"drills.schedule[{number}]"
        validate(schedule, where)
        try:
            trigger = CronTrigger.from_crontab(schedule.cron, timezone=timezone.utc)
        except ValueError as exc:
            raise ConfigError(f"{where}: cron {schedule.cron!r}: {exc}") from None
        found.append(Entry(number, schedule, trigger))
    return found


def validate(schedule: DrillSchedule, where: str) -> None:
    """Check an entry (or an on-demand request) without its cron string.

    Raises:
        ConfigError: naming `where` and what is wrong.
    """
    kind = KINDS.get(schedule.drill)
    if kind is None:
        raise ConfigError(f"{where}: drill {schedule.drill!r} is not one of {', '.join(KINDS)}")
    if kind.destructive and not schedule.allow_destructive:
        raise ConfigError(f"{where}: {kind.name} touches the card; set allow_destructive = true to schedule it")
    if schedule.gpu not in {IDLE, TRAINER} and not schedule.gpu.isdigit():
        raise ConfigError(f"{where}: gpu {schedule.gpu!r} is not an index, 'idle' or 'trainer'")
    if kind.name in RANK_KINDS and schedule.gpu == IDLE:
        raise ConfigError(f"{where}: {kind.name} needs a GPU with a trainer: gpu = 'trainer' or an index")
    if kind.name == "inject":
        parse_inject(schedule.args, where=f"{where}: args", need_gpu=False)
    elif kind.name == "dcgm_inject":
        parse_dcgm(schedule.args, where=f"{where}: args", need_gpu=False)
    elif schedule.args:
        raise ConfigError(f"{where}: args: {kind.name} takes none")
    if not 0.0 <= schedule.require_healthy_share <= 1.0:
        raise ConfigError(f"{where}: require_healthy_share {schedule.require_healthy_share} is not in [0, 1]")


def next_runs(entry: Entry, after: datetime, count: int = 3) -> list[datetime]:
    """The next `count` run times of a scheduled entry (UTC)."""
    assert entry.trigger is not None
    times: list[datetime] = []
    previous, now = None, after
    while len(times) < count:
        upcoming = entry.trigger.get_next_fire_time(previous, now)
        if upcoming is None:
            break
        times.append(upcoming)
        previous, now = upcoming, upcoming + timedelta(seconds=1)
    return times


def pick_target(schedule: DrillSchedule, node: list[wire.Gpu]) -> int:
    """The GPU this run drills, after the node-level guards.

    Raises:
        DrillRefused: the node or the target is not in a state the drill allows.
    """
    fit = [g for g in node if g.state == "healthy" and not g.quarantined]
    if len(fit) < schedule.require_healthy_share * len(node) - 1e-9:
        raise DrillRefused(
            "node_unhealthy",
            f"{len(fit)} of {len(node)} GPUs are healthy and in service, under "
            f"require_healthy_share = {schedule.require_healthy_share:g}",
        )
    if schedule.gpu == IDLE:
        idle = [g for g in fit if not pids(g)]
        if not idle:
            raise DrillRefused("no_idle_gpu", "no healthy, unquarantined GPU without processes")
        return idle[0].index
    if schedule.gpu == TRAINER:
        busy = [g for g in fit if g.trainers]
        if not busy:
            raise DrillRefused("no_trainer", "no healthy, unquarantined GPU with a trainer")
        return busy[0].index
    target = next((g for g in node if g.index == int(schedule.gpu)), None)
    if target is None:
        raise DrillRefused("no_such_gpu", f"the daemon has no GPU {schedule.gpu}")
    if schedule.skip_if_trainers and schedule.drill not in RANK_KINDS and target.trainers:
        raise DrillRefused("target_busy", f"GPU {schedule.gpu} has trainers and skip_if_trainers is set")
    return target.index


class DrillScheduler:
    """Runs drills inside the daemon, one at a time: scheduled entries and POST /v1/drills/run."""

    def __init__(self, config: Config, api: Callable[[], DrillApi], book: DrillRecord, clock: Clock) -> None:
        self.config = config
        self.entries = entries(config)
        self.api = api
        self._book = book
        self.clock = clock
        self._running = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._running.locked()

    def add_jobs(self, scheduler: BaseScheduler) -> None:
        for entry in self.entries:
            scheduler.add_job(
                self.run,
                entry.trigger,
                args=[entry],
                id=f"drill-{entry.number}",
                name=f"drill {entry.schedule.drill} ({entry.schedule.cron})",
                coalesce=True,
                misfire_grace_time=max(1, round(self.config.drills.misfire_grace_s)),
                max_instances=1,
            )
            log.info(
                "drill %s scheduled (%s UTC) on GPU %s", entry.schedule.drill, entry.schedule.cron, entry.schedule.gpu
            )

    def submit(self, scheduler: BaseScheduler, schedule: DrillSchedule) -> None:
        """Run one drill now, in the scheduler's threads (POST /v1/drills/run)."""
        scheduler.add_job(self.run, args=[Entry(-1, schedule, None)], name=f"drill {schedule.drill} (on demand)")

    def schedule_view(self, now: datetime) -> list[wire.ScheduleEntry]:
        """Each scheduled entry with its next runs, for GET /v1/drills."""
        from gpuwatch.serving import wire

        return [
            wire.ScheduleEntry(
                entry=e.number,
                cron=e.schedule.cron,
                drill=e.schedule.drill,
                gpu=e.schedule.gpu,
                next_runs=[t.isoformat() for t in next_runs(e, now)],
            )
            for e in self.entries
        ]

    def run(self, entry: Entry) -> Verdict | None:
        """One run: guards, target, drill, verdict recorded. A refusal is a counted skip, not a verdict."""
        schedule = entry.schedule
        if not self._running.acquire(blocking=False):
            self._book.skip(schedule.drill, "drill_running", "another drill is running")
            return None
        try:
            api = self.api()
            target = pick_target(schedule, gpus(api))
            request = Request(
                schedule.drill,
                target,
                spec=schedule.args,
                await_release=self.config.drills.await_release,
                trigger="schedule" if entry.trigger is not None else "api",
            )
            run = prepare(request, api, self.config, self.clock)
            log.warning("drill %s starts on GPU %d (%s)", schedule.drill, target, request.trigger)
            verdict = run_drill(run)
            self._book.record(verdict.as_dict())
            return verdict
        except DrillRefused as exc:
            self._book.skip(schedule.drill, exc.reason, str(exc))
        except GpuwatchError as exc:
            self._book.skip(schedule.drill, "error", str(exc))
        finally:
            self._running.release()
        return None
