"""NVIDIA XID codes as data: xid → (severity, action, short description).

Source (docs/hardware-facts.md §The XID catalog): NVIDIA's XID catalog for Ampere and newer
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html and its Xid-Catalog.xlsx,
as mirrored by leptonai/gpud on 2025-10-29), cross-checked with NVIDIA NVSentinel's
xiderrorsmapping.csv (FATAL / NONFATAL).

How the catalog's columns become ours:

* severity: FATAL in NVSentinel → unhealthy; application errors (immediate bucket RESTART_APP)
  → warning; informational codes (bucket IGNORE, nothing to do) → info.
* action: the immediate resolution bucket: RESTART_APP → restart_app, RESET_GPU and the ECC and
  NVLink workflows → reset_gpu, RESTART_BM → reboot, CONTACT_SUPPORT → hardware_inspection.

gpuwatch is stricter than the catalog on three codes, on purpose: 92 (excessive SBE interrupts,
IGNORE) is a card on its way to failing memory; 94 (contained memory error, RESTART_APP) leaves
a row remap that needs a GPU reset on H100/H200; 154 (recovery action changed) means the driver
itself asks for a reset or reboot. Codes not listed here (and 999, NVML's "unknown Xid") get
UNKNOWN: a warning that condemns nothing.
"""

from __future__ import annotations

from typing import NamedTuple

from gpuwatch.model import Action, Severity


class XidInfo(NamedTuple):
    severity: Severity
    action: Action
    description: str


_APP = (Severity.WARNING, Action.RESTART_APP)
_RESET = (Severity.UNHEALTHY, Action.RESET_GPU)

CATALOG: dict[int, XidInfo] = {
    13: XidInfo(*_APP, "graphics engine exception"),
    31: XidInfo(*_APP, "GPU memory page fault"),
    43: XidInfo(*_APP, "GPU stopped processing (channel reset)"),
    45: XidInfo(*_APP, "preemptive cleanup after previous errors"),
    46: XidInfo(*_RESET, "GPU stopped processing (timeout)"),
    48: XidInfo(*_RESET, "double-bit ECC error"),
    61: XidInfo(Severity.UNHEALTHY, Action.HARDWARE_INSPECTION, "internal micro-controller breakpoint"),
    62: XidInfo(*_RESET, "internal micro-controller halt"),
    63: XidInfo(Severity.INFO, Action.NONE, "GPU memory row remapping event"),
    64: XidInfo(*_RESET, "GPU memory row remapping failure"),
    68: XidInfo(*_APP, "NVDEC0 error"),
    69: XidInfo(*_APP, "graphics engine class error"),
    74: XidInfo(*_RESET, "NVLink error"),
    79: XidInfo(Severity.UNHEALTHY, Action.REBOOT, "GPU has fallen off the bus"),
    92: XidInfo(Severity.UNHEALTHY, Action.HARDWARE_INSPECTION, "excessive single-bit ECC error rate"),
    94: XidInfo(*_RESET, "contained memory error"),
    95: XidInfo(*_RESET, "uncontained memory error"),
    109: XidInfo(*_RESET, "context switch timeout"),
    119: XidInfo(*_RESET, "GSP RPC timeout"),
    120: XidInfo(*_RESET, "GSP error"),
    121: XidInfo(Severity.WARNING, Action.NONE, "C2C link error"),
    136: XidInfo(*_RESET, "link training failed"),
    140: XidInfo(*_RESET, "unrecovered ECC error escape"),
    143: XidInfo(*_RESET, "GPU initialization error"),
    144: XidInfo(*_RESET, "NVLink5 SAW error"),
    145: XidInfo(*_RESET, "NVLink5 RLW error"),
    146: XidInfo(*_RESET, "NVLink5 TLW error"),
    147: XidInfo(*_RESET, "NVLink5 TREX error"),
    148: XidInfo(*_RESET, "NVLink5 NVLPW_CTRL error"),
    149: XidInfo(*_RESET, "NVLink5 NETIR error"),
    150: XidInfo(*_RESET, "NVLink5 MSE error"),
    154: XidInfo(*_RESET, "GPU recovery action changed"),
    155: XidInfo(*_RESET, "NVLink software-defined error"),
    156: XidInfo(*_RESET, "resource retirement event"),
    158: XidInfo(*_RESET, "GPU fatal timeout"),
}

UNKNOWN = XidInfo(Severity.WARNING, Action.NONE, "not in gpuwatch's XID catalog")


def lookup(xid: int) -> XidInfo:
    """What gpuwatch knows about `xid` (UNKNOWN when nothing)."""
    return CATALOG.get(xid, UNKNOWN)
