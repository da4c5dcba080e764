"""The runtime directory's contract (gpuwatch.trainer.contract) is the one spelling both sides follow."""

from __future__ import annotations

import dataclasses

import pytest

from gpuwatch.model import GpuStatic, GpuStatus, Health, Snapshot, TrainerInfo
from gpuwatch.node.runtime import status_body
from gpuwatch.reports.parse import _FIELDS
from gpuwatch.trainer.contract import (
    PAUSE_LAYOUT,
    STEP_LAYOUT,
    STEP_PAGE_MAGIC,
    Status,
    StatusGpu,
    StepPage,
    TrainerReport,
    quarantined_in,
    read_step_page,
    step_page_name,
    step_page_pid,
)


def keys(typed: type) -> set[str]:
    return set(typed.__required_keys__ | typed.__optional_keys__)  # type: ignore[attr-defined]


def test_the_daemon_checks_every_field_a_rank_reports() -> None:
    assert set(_FIELDS) == keys(TrainerReport) - {"t", "pid"}


def test_a_report_reads_into_a_trainer_info_field_by_field() -> None:
    """The daemon's TrainerInfo holds each report field under its own name; `t` becomes `updated_t`.

    `uid` is the daemon's own: the kernel names the sender's user, the report never does.
    """
    assert keys(TrainerReport) - {"t"} == {f.name for f in dataclasses.fields(TrainerInfo)} - {"updated_t", "uid"}


def test_status_json_writes_the_contracts_keys() -> None:
    gpu = GpuStatus(GpuStatic(0, "GPU-0"), Health.HEALTHY)
    body = status_body(Snapshot(5.0, "sim", (gpu,)))
    assert set(body) == keys(Status)
    assert set(body["gpus"][0]) == keys(StatusGpu)


@pytest.mark.parametrize("pid", [1, 42, 4_194_304])
def test_step_page_pid_reads_back_step_page_name(pid: int) -> None:
    assert step_page_pid(step_page_name(pid)) == pid


@pytest.mark.parametrize("name", ["0.step", "012.step", "12345678.step", "12.step.tmp", ".12.step", "x.step", "12"])
def test_step_page_pid_is_none_for_any_other_entry(name: str) -> None:
    assert step_page_pid(name) is None


@pytest.mark.parametrize(
    ("fields", "page"),
    [
        (
            (STEP_PAGE_MAGIC, 228, 201, 1_800_000_000.5, 1_799_999_990.0),
            StepPage(228, 201, 1_800_000_000.5, 1_799_999_990.0),
        ),
        ((STEP_PAGE_MAGIC, -1, -1, 0.0, 0.0), StepPage(None, None, None)),
        ((b"GWSTEP0\0", 228, 201, 1.0, 1.0), None),
        ((STEP_PAGE_MAGIC, -5, 1, 1.0, 1.0), None),
        ((STEP_PAGE_MAGIC, 5, 1, float("nan"), 1.0), None),
        ((STEP_PAGE_MAGIC, 5, 1, -1.0, 1.0), None),
        ((STEP_PAGE_MAGIC, 5, 1, 1.0, float("inf")), None),
    ],
)
def test_a_step_page_reads_back_or_is_refused(fields: tuple[object, ...], page: StepPage | None) -> None:
    assert read_step_page(STEP_LAYOUT.pack(*fields) + bytes(24)) == page


def test_a_short_step_page_is_refused() -> None:
    assert read_step_page(STEP_PAGE_MAGIC + bytes(8)) is None


@pytest.mark.parametrize(
    ("status", "quarantined"),
    [
        ({"gpus": [{"uuid": "GPU-1", "quarantined": True}]}, True),
        ({"gpus": [{"uuid": "GPU-2", "quarantined": True}, {"uuid": "GPU-1", "quarantined": False}]}, False),
        ({"gpus": [{"uuid": "GPU-1", "quarantined": "yes"}]}, False),
        ({"gpus": "GPU-1"}, False),
        ([], False),
    ],
)
def test_quarantined_in_reads_status_json_as_the_daemon_writes_it(status: object, quarantined: bool) -> None:
    assert quarantined_in(status, "GPU-1") is quarantined


@pytest.mark.parametrize(
    ("pause_until", "read"),
    [(0.0, None), (1_800_000_600.0, 1_800_000_600.0), (float("nan"), "refused"), (-1.0, "refused")],
)
def test_a_step_pages_pause_slot_reads_back_or_the_page_is_refused(pause_until: float, read: object) -> None:
    """A page of an older link has 0 there: no pause; a nonsense end makes the page nonsense."""
    data = STEP_LAYOUT.pack(STEP_PAGE_MAGIC, 228, 201, 1.0, 1.0) + PAUSE_LAYOUT.pack(pause_until) + bytes(16)
    page = read_step_page(data)
    assert (page.pause_until if page is not None else "refused") == read
