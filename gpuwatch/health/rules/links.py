"""Links: a PCIe link trained down, PCIe and NVLink error rates, NVLinks down, an NVSwitch fabric not ready.

* `pcie_link_degraded`: the current generation or width below the most the GPU and slot allow,
  for `link_duty` of `link_window_s`, counted only while the GPU is busy: links may train down at
  idle to save power (the lab's H200 reads gen 5 x16 both idle and under load). A GPU on x8 runs
  every host copy at half speed, which no other check notices.
* `pcie_error_rate`: correctable errors plus replays grown over `link_error_window_s` above
  `pcie_errors_per_hour`.
* `nvlink_down`: any NVLink of the GPU not active for `link_duty` of `link_window_s`.
* `nvlink_error_rate`: CRC plus recovery errors of all links above `nvlink_errors_per_hour`.
* `fabric_not_ready`: on an NVSwitch system, the GPU's fabric registration not completed (or
  completed with an error) for `link_duty` of `link_window_s`: without it, NVLink peers are unreachable.

None ("not supported": a PCIe-only card has no NVLink, most have no fabric) is silence, never a finding.
"""

from __future__ import annotations

from gpuwatch.config import RulesConfig
from gpuwatch.health.evidence import Condition, Evidence, Windowed, finding
from gpuwatch.health.history import History
from gpuwatch.model import Action, Finding, GpuSample, GpuStatic, Severity

PCIE_DEGRADED = "pcie_link_degraded"
PCIE_ERRORS = "pcie_error_rate"
NVLINK_DOWN = "nvlink_down"
NVLINK_ERRORS = "nvlink_error_rate"
FABRIC = "fabric_not_ready"
RULE_IDS: tuple[str, ...] = (PCIE_DEGRADED, PCIE_ERRORS, NVLINK_DOWN, NVLINK_ERRORS, FABRIC)

FABRIC_COMPLETED = 3  # ref. nvml.h NVML_GPU_FABRIC_STATE_COMPLETED
PCIE_COUNTERS = ("pcie_correctable_errors", "pcie_replay")
NVLINK_COUNTERS = ("nvlink_crc_errors", "nvlink_recovery_errors")


def conditions(static: GpuStatic, cfg: RulesConfig) -> tuple[Condition, ...]:
    window = cfg.link_window_s
    busy = cfg.clock_busy_util_pct
    gen_max, width_max = static.pcie_link_gen_max, static.pcie_link_width_max

    def pcie_down(s: GpuSample) -> bool:
        if s.util_gpu_pct is None or s.util_gpu_pct < busy:
            return False
        slow_gen = gen_max is not None and s.pcie_link_gen is not None and s.pcie_link_gen < gen_max
        narrow = width_max is not None and s.pcie_link_width is not None and s.pcie_link_width < width_max
        return slow_gen or narrow

    def fabric_bad(s: GpuSample) -> bool:
        if s.fabric_state is None:
            return False
        return s.fabric_state != FABRIC_COMPLETED or bool(s.fabric_status)

    errors = cfg.link_error_window_s
    return (
        Condition(PCIE_DEGRADED, "held", window, pcie_down),
        Condition(NVLINK_DOWN, "held", window, lambda s: bool(s.nvlink_links_down)),
        Condition(FABRIC, "held", window, fabric_bad),
        *(Condition(counter, "growth", errors) for counter in (*PCIE_COUNTERS, *NVLINK_COUNTERS)),
    )


def evaluate(history: History, cfg: RulesConfig) -> list[Finding]:
    """The windowed reference: judge() over a rescan of `history`."""
    return judge(Windowed(history, conditions(history.static, cfg)), cfg)


def judge(evidence: Evidence, cfg: RulesConfig) -> list[Finding]:
    head, last = evidence.head, evidence.head.last
    static = head.static
    findings: list[Finding] = []
    pcie = evidence.held(PCIE_DEGRADED)
    if pcie.sustained(cfg.link_duty) and last is not None:
        reason = (
            f"PCIe link at gen {last.pcie_link_gen} x{last.pcie_link_width} of gen {static.pcie_link_gen_max} "
            f"x{static.pcie_link_width_max} while busy for {pcie.describe()}"
        )
        findings.append(finding(head, PCIE_DEGRADED, Severity.DEGRADED, Action.HARDWARE_INSPECTION, reason))
    findings += _rate(
        evidence, cfg, PCIE_ERRORS, PCIE_COUNTERS, cfg.pcie_errors_per_hour, "PCIe correctable errors and replays"
    )
    nvlink = evidence.held(NVLINK_DOWN)
    if nvlink.sustained(cfg.link_duty) and last is not None:
        reason = f"{last.nvlink_links_down or 'some'} NVLink(s) not active for {nvlink.describe()}"
        findings.append(finding(head, NVLINK_DOWN, Severity.DEGRADED, Action.RESET_GPU, reason))
    findings += _rate(
        evidence, cfg, NVLINK_ERRORS, NVLINK_COUNTERS, cfg.nvlink_errors_per_hour, "NVLink CRC and recovery errors"
    )
    fabric = evidence.held(FABRIC)
    if fabric.sustained(cfg.link_duty) and last is not None:
        reason = (
            f"NVSwitch fabric registration state {last.fabric_state} (3 is completed), status "
            f"{last.fabric_status} for {fabric.describe()}"
        )
        findings.append(finding(head, FABRIC, Severity.UNHEALTHY, Action.RESET_GPU, reason))
    return findings


def _rate(
    evidence: Evidence, cfg: RulesConfig, rule: str, counters: tuple[str, ...], per_hour: float, what: str
) -> list[Finding]:
    window = cfg.link_error_window_s
    total = sum([evidence.growth(counter) for counter in counters])
    if total <= per_hour * window / 3600.0:  # over the whole window: a daemon that just started needs the full count
        return []
    reason = f"{total} {what} in the last {window:g} s (limit {per_hour:g} per hour)"
    return [finding(evidence.head, rule, Severity.DEGRADED, Action.HARDWARE_INSPECTION, reason)]
