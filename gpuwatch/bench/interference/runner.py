"""Time the job through a plan of segments, each condition resumed around its own, and sum the result up."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from gpuwatch.bench import stats
from gpuwatch.bench.harness import progress
from gpuwatch.bench.interference.beside import Beside
from gpuwatch.bench.interference.plan import Segment, round_seconds

ALONE_SETTLE_S = 0.1  # after a monitor is frozen or a loop stopped, before the alone segment is timed
Timed = list[tuple[str, list[float]]]


class Job(Protocol):
    def start(self) -> None: ...

    def stop(self) -> list[float]: ...


def time_segments(job: Job, segments: Sequence[Segment], besides: Mapping[str, Beside], what: str) -> Timed:
    """Each segment's step times, in order; a condition's Beside is resumed around its segment only.

    A condition that cannot resume (a restarted monitor that does not start again) loses that segment;
    its neighbours then compare as alone with alone, and its round drops out of the differences.
    """
    timed: Timed = []
    next_progress = time.monotonic() + 30
    for number, segment in enumerate(segments, 1):
        beside = besides.get(segment.key)
        if beside is not None:
            try:
                beside.resume()
            except RuntimeError as exc:  # a monitor that started before and not now: this segment only is lost
                progress(f"interference: {what}: {segment.key} did not start, segment left out: {exc}")
                continue
        time.sleep(beside.settle_s if beside is not None else ALONE_SETTLE_S)
        job.start()
        time.sleep(segment.seconds)
        steps = job.stop()
        if beside is not None:
            beside.pause()
        timed.append((segment.key, steps))
        if time.monotonic() >= next_progress:
            next_progress += 30
            progress(f"interference: {what}: segment {number}/{len(segments)}")
    return timed


def planned_round_s(besides: Iterable[Beside], seconds: float) -> float:
    """One round of `besides` with segments of `seconds`: each one's start and settle, and alone's settle."""
    return round_seconds(seconds, [b.start_s + b.settle_s + ALONE_SETTLE_S for b in besides])


def differences(timed: Timed, pairs: Iterable[tuple[str, str, str]]) -> dict[str, dict[str, Any]]:
    """For each (key, other, label) whose conditions both ran: key minus other, round by round, p50 and mean."""
    segments = [(key, stats.summarize_steps(steps)) for key, steps in timed]
    ratios = {stat: stats.paired_ratios(segments, stat) for stat in stats.STATS}
    found: dict[str, dict[str, Any]] = {}
    for key, other, label in pairs:
        # one ratio a round each, in order; a round one of them lost leaves the two no longer paired
        if key in ratios["mean"] and other in ratios["mean"] and len(ratios["mean"][key]) == len(ratios["mean"][other]):
            entry: dict[str, Any] = {"label": label}
            for stat in stats.STATS:
                entry[stat] = stats.difference(ratios[stat][key], ratios[stat][other]).as_pct()
            found[f"{key}-{other}"] = entry
    return found


def summarize(timed: Timed, labels: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Per condition: its pooled steps (ms), how many segments, and p50 and mean against alone with intervals.

    Under `alone` the comparison is the placebo (alone against the alone segments two places away).
    """
    segments = [(key, stats.summarize_steps(steps)) for key, steps in timed]
    pooled = stats.pooled(timed)
    ratios = {stat: stats.paired_ratios(segments, stat) for stat in stats.STATS}
    result: dict[str, dict[str, Any]] = {}
    for key, steps in pooled.items():
        entry: dict[str, Any] = {"label": labels.get(key, key), "segments": sum(k == key for k, _ in segments)}
        entry.update(steps.as_ms())
        for stat in stats.STATS:
            if ratios[stat].get(key):
                entry[f"{stat}_vs_alone"] = stats.interval(ratios[stat][key]).as_pct()
        result[key] = entry
    return result
