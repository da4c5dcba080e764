"""Every knob of gpuwatch, its default, and the one loader of config files and GPUWATCH_* variables.

Precedence: command-line flags, then environment, then the TOML file, then defaults.
A top-level key `interval_s` is GPUWATCH_INTERVAL_S; a key in a section, `[sim] gpus`,
is GPUWATCH_SIM_GPUS. Anything wrong raises ConfigError with one line naming where.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import stat
import sys
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.trainer.contract import DEFAULT_RUNTIME_DIR

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/gpuwatch/gpuwatch.toml")
ENV_PREFIX = "GPUWATCH_"
DEFAULT_PORT = 9835
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few KiB; /dev/zero or a stray log must not be read whole
MAX_DURATION_S = 10 * 365.25 * 86400.0  # every `_s` setting: a longer one is a typo, not a policy
UNCATCHABLE_SIGNALS = frozenset({"SIGKILL", "SIGSTOP"})


@dataclass(frozen=True)
class SimConfig:
    """The simulated node (`--backend sim`)."""

    gpus: int = 8
    seed: int = 0
    scenario: str = "demo"
    kernel_log: bool = False  # follow tools.kmsg as on real GPUs (a FIFO of kmsg lines: the bench, the tests)


@dataclass(frozen=True)
class RulesConfig:
    """Thresholds and windows of the health rules; windows are seconds, never sample counts."""

    disabled: tuple[str, ...] = ()
    clock_window_s: float = 60.0
    clock_low_ratio: float = 0.6
    clock_busy_util_pct: int = 50
    throttle_duty: float = 0.5
    level_duty: float = 0.8  # share of its window a level condition (low SM clock, thermal margin) must hold
    power_window_s: float = 120.0
    power_min_util_pct: int = 90
    power_unstable_drop_ratio: float = 0.5
    ecc_window_s: float = 3600.0
    ecc_sbe_per_hour: float = 1000.0
    xid_window_s: float = 600.0
    xid_app_repeats: int = 3
    thermal_margin_c: int = 5
    thermal_window_s: float = 60.0
    link_window_s: float = 60.0  # PCIe width/generation and NVLink/fabric state are judged over this
    link_duty: float = 0.5  # share of link_window_s a link must be down (PCIe: while busy) to be flagged
    link_error_window_s: float = 3600.0  # PCIe and NVLink error counters are rates over this
    pcie_errors_per_hour: float = 100.0  # PCIe correctable errors + replays
    nvlink_errors_per_hour: float = 100.0  # NVLink CRC + recovery errors, all links


@dataclass(frozen=True)
class PolicyConfig:
    """What the state machine does with findings: quarantine, release, circuit breaker."""

    quarantine_on_unhealthy: bool = True
    quarantine_degraded_after_s: float = 900.0
    recovery_s: float = 120.0
    burn_in_s: float = 1800.0
    breaker_max_share: float = 0.25
    breaker_window_s: float = 3600.0
    repeat_quarantines: int = 3  # this many automatic quarantines of one uuid within repeat_window_s …
    repeat_window_s: float = 7 * 86400.0  # … escalate it to hardware_inspection, held until an operator releases


@dataclass(frozen=True)
class TrainerConfig:
    """How the daemon talks to the trainers beside it and judges their reports."""

    stop_signal: str = "SIGUSR1"
    grace_period_s: float = 60.0  # stop signal → SIGTERM for a rank that has not exited
    kill_after_s: float = 5.0  # SIGTERM → SIGKILL
    stale_after_s: float = 60.0
    fragmentation_ratio: float = 0.3
    fragmentation_window_s: float = 300.0
    alloc_retries_per_min: float = 10.0
    alloc_retries_window_s: float = 300.0
    straggler_ratio: float = 1.25
    grad_var_jump: float = 10.0
    grad_var_history_s: float = 1800.0  # the running level the latest grad-norm variance is compared to
    hang_after_s: float = 60.0  # a job whose steps stop this long (at least) is hung: trainer_hang
    hang_step_times: float = 10.0  # ... or this many of its recent step times, when that is longer
    hang_idle_util_pct: int = 5  # where the backend sees the job's GPUs, "idle" is at most this utilization
    hang_stopped_after_s: float = 1.0  # a rank stopped (state T) this long, its step still, hangs its job
    hang_frozen_after_s: float = 10.0  # a rank whose main thread's CPU time, step and GPU stand still this long ...
    hang_frozen_step_times: float = 20.0  # ... or this many of its p99 step time, when longer, hangs its job
    max_pause_s: float = 3600.0  # a declared pause counts as progress at most this long after the rank's last step
    restart_hung_jobs: bool = True  # stop a hung job (stop signal, SIGTERM, SIGKILL) so its launcher relaunches it
    spares: int = 0  # warm standby workers per node that gpuwatch launch --in-place keeps (gpuwatch.spares)
    spare_cuda_context: bool = False  # each spare also creates its CUDA context (GPU memory) while it waits
    spare_standby: bool = True  # each spare runs the job's own set-up and waits at its join (docs/spares.md)


@dataclass(frozen=True)
class ToolsConfig:
    """Paths to the programs and trees drills touch; tests point them at fakes."""

    nvidia_smi: str = "nvidia-smi"
    dcgmi: str = "dcgmi"
    sysfs_root: str = "/sys"
    kmsg: str = "/dev/kmsg"  # the kernel log the xid_fault drill reads for the driver's "NVRM: Xid" line
    xid_fault: str = ""  # the sacrificial CUDA process; "" is gpuwatch/drills/xid_fault.py of this install
    dcgm_bindings: tuple[str, ...] = (
        "/usr/share/datacenter-gpu-manager-4/bindings/python3",
        "/usr/local/dcgm/bindings/python3",
    )


# [nvml] events: which NVML event set the nvml backend registers (docs/events.md says why auto is the default).
NVML_EVENT_MODES = ("auto", "xid", "all", "none")


@dataclass(frozen=True)
class NvmlConfig:
    """[nvml]: the nvml backend's event set. XIDs also come from the kernel log, so it may stand down there."""

    # auto: no event set on a GPU the kernel log covers, XID events on the others | xid: XID events on
    # every GPU | all: XID, double-bit and single-bit ECC events on every GPU | none: no event set at all
    events: str = "auto"


@dataclass(frozen=True)
class ValidationConfig:
    """[validation]: the active test a quarantined, idle GPU passes before it goes back into service."""

    before_release: bool = True  # run it before a burn-in release (live backends: nvml, dcgm)
    program: str = ""  # the GPU test; "" is `python3 -m gpuwatch.validation.gpu_test` (needs torch with CUDA)
    timeout_s: float = 180.0
    tolerance: float = 0.15  # a figure may fall this far below its reference and pass
    matmul_tflops: float = 0.0  # reference override; 0: the model's figure (gpuwatch/validation/references.py)
    mem_bandwidth_gbps: float = 0.0  # reference override, likewise
    dcgm_diag: bool = True  # also run `dcgmi diag -r 1` on the GPU when dcgmi is installed


@dataclass(frozen=True)
class DrillSchedule:
    """One `[[drills.schedule]]` entry: when, what, on which GPU, and what must hold first."""

    cron: str
    drill: str
    gpu: str = "idle"
    args: str = ""
    require_healthy_share: float = 1.0
    skip_if_trainers: bool = True  # kill_rank, hang_rank, fault_rank ignore it: their target must have a trainer
    allow_destructive: bool = False  # reset_gpu and pcie_remove run on a schedule only with this set


@dataclass(frozen=True)
class DrillsConfig:
    """Fault-injection drills and their schedule."""

    schedule: tuple[DrillSchedule, ...] = ()
    detect_timeout_s: float = 30.0  # slack after a sampled fault's rule window for the finding to show
    event_detect_timeout_s: float = 2.0  # deadline for the finding of an event fault (XID, ECC), judged at once
    resume_timeout_s: float = 300.0  # deadline for a stopped or killed job to run again
    burn_in_s: float = 300.0  # clean seconds a reset or re-plugged GPU shows before the drill releases it
    burn_in_timeout_s: float = 3600.0  # beyond the burn-in itself, how long a drill waits for the release
    await_release: bool = False  # inject-type drills also wait for the daemon's burn-in release
    poll_s: float = 0.25  # how often a verdict step looks at the daemon
    misfire_grace_s: float = 300.0  # a scheduled run this late is dropped, never replayed


@dataclass(frozen=True)
class ApiConfig:
    """Limits of the HTTP server, enforced before the token check, and whether the API schema is served."""

    docs: bool = False  # serve /openapi.json to anyone who can reach `listen`
    max_connections: int = 1000  # open connections; at the cap the longest-idle one is closed for a new one
    header_timeout_s: float = 10.0  # a request's line and headers must arrive within this (slowloris)
    max_header_bytes: int = 16384  # request line and headers; more is 431
    max_body_bytes: int = 65536  # request body; more is 413
    socket: str = ""  # the control socket (the CLI's way in); "": <state_dir>/api.sock
    admin_group: str = ""  # besides root, members of this group may change state over the control socket
    allowed_hosts: tuple[str, ...] = ()  # Host names the TCP listener answers besides loopback, IPs and this host's


@dataclass(frozen=True)
class SlurmConfig:
    """Draining this node in Slurm while gpuwatch holds a GPU out of service (gpuwatch/cluster/slurm.py)."""

    enabled: bool = False
    node_name: str = ""  # "": this host's short name, as Slurm names nodes
    drain_on: str = "unhealthy"  # unhealthy | any_quarantine | usable_below
    min_usable_gpus: int = 1  # drain_on = usable_below: drain when fewer GPUs than this are usable
    scontrol: str = "scontrol"
    timeout_s: float = 10.0  # one scontrol call; a hung slurmctld must not hang gpuwatch
    retry_max_s: float = 300.0  # back-off after failed calls doubles from 1 s up to this
    reconcile_s: float = 60.0  # re-read the node's state this often even when nothing changed


@dataclass(frozen=True)
class FleetConfig:
    """The fleet-wide circuit breaker: Prometheus' view of every node, asked before acting
    (gpuwatch/cluster/fleet.py)."""

    prometheus_url: str = ""  # "": off
    max_quarantined_share: float = 0.1  # refuse when this share of the fleet's GPUs is quarantined
    max_drained_nodes: int = 5  # refuse a Slurm drain when this many nodes were drained by gpuwatch in the window
    window_s: float = 3600.0
    timeout_s: float = 2.0
    cache_s: float = 15.0  # one answer serves the decisions of this many seconds (the rules are evaluated as often)
    on_unreachable: str = "open"  # open: the node breaker alone decides | closed: refuse


@dataclass(frozen=True)
class Config:
    """The whole configuration. Build with `load()`; `Config()` is all defaults."""

    backend: str = "auto"
    expected_gpus: int = 0  # 0: the count seen at start; else fewer visible is gpu_missing on the node
    interval_s: float = 30.0
    slow_interval_s: float = 300.0
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    state_dir: str = "/var/lib/gpuwatch"
    runtime_dir: str = DEFAULT_RUNTIME_DIR
    log_level: str = "info"
    findings_retention_days: float = 30.0
    replay_file: str = ""
    sim: SimConfig = field(default_factory=SimConfig)
    rules: RulesConfig = field(default_factory=RulesConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    drills: DrillsConfig = field(default_factory=DrillsConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    nvml: NvmlConfig = field(default_factory=NvmlConfig)

    @property
    def listen_host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def listen_port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])

    @property
    def token_path(self) -> Path:
        return Path(self.state_dir) / "token"

    @property
    def db_path(self) -> Path:
        return Path(self.state_dir) / "gpuwatch.db"

    @property
    def control_socket(self) -> Path:
        return Path(self.api.socket) if self.api.socket else Path(self.state_dir) / "api.sock"


def load(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    known_rules: Collection[str] | None = None,
    flag_names: Mapping[str, str] | None = None,
) -> Config:
    """Build a validated Config from a TOML file, the environment and flag overrides.

    Args:
        path: the TOML file; None means /etc/gpuwatch/gpuwatch.toml if it exists
            (or GPUWATCH_CONFIG when set).
        environ: variables to read GPUWATCH_* from (default: os.environ).
        overrides: dotted keys from the command line (`sim.gpus`), None values ignored.
        known_rules: the rule ids and rule modules `rules.disabled` may name (the health layer's
            catalog, handed in by the commands that judge GPUs); None leaves `rules.disabled` unchecked.
        flag_names: the flag that sets a dotted key, where it is not `--key-with-dashes` (`interval_s`:
            `--interval`), so an error names the flag the user typed.

    Raises:
        ConfigError: naming the file, key or variable and what is wrong.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = "defaults"
    file_path = config_file(path, env)
    if file_path is not None:
        data = _read_toml(file_path)
        source = str(file_path)
    config = _build(Config, data, source, "")
    given = {key: f"in {source}" for key in _dotted_keys(data)}
    config = _apply_env(config, env, given)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            where = f"option {(flag_names or {}).get(dotted) or '--' + dotted.replace('_', '-')}"
            config = _set_dotted(config, dotted, value, where)
            given[dotted] = f"from {where}"
    try:
        validate(config, known_rules)
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({_provenance(str(exc), given, source)})") from None
    return config


def _dotted_keys(data: Mapping[str, Any]) -> list[str]:
    """`interval_s`, `rules.disabled`, ... for every key a config file sets (one level of sections)."""
    keys = []
    for key, value in data.items():
        if isinstance(value, Mapping):
            keys += [f"{key}.{sub}" for sub in value]
        keys.append(key)
    return keys


def _provenance(message: str, given: Mapping[str, str], source: str) -> str:
    """Where the setting a validation error names came from: the file, a variable or an option."""
    named = re.match(r"[a-z_]+(?:\.[a-z_]+)?", message)
    key = named.group(0) if named else ""
    return given.get(key) or given.get(key.split(".")[0]) or (f"in {source}" if source != "defaults" else "the default")


def config_file(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The file `load()` reads: `path`, else $GPUWATCH_CONFIG, else /etc/gpuwatch/gpuwatch.toml when it exists.

    GPUWATCH_CONFIG set but empty reads no file at all: a test or a tool that starts gpuwatch beside a node's
    own daemon must not pick up that node's config.
    """
    if path is not None:
        return Path(path)
    named = (os.environ if environ is None else environ).get(ENV_PREFIX + "CONFIG")
    if named is not None:
        return Path(named) if named else None
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None


def validate(config: Config, known_rules: Collection[str] | None = None) -> None:
    """Check values that types alone do not catch; `known_rules`: what `rules.disabled` may name.

    Raises:
        ConfigError: naming the key and the bad value.
    """
    _check_finite(config)
    if not 1.0 <= config.interval_s <= 3600.0:
        raise ConfigError(f"interval_s: {config.interval_s} is out of range (1 to 3600 seconds)")
    host, sep, port = config.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"listen: {config.listen!r} is not HOST:PORT (a port from 1 to 65535)")
    if config.log_level.lower() not in {"debug", "info", "warning", "error"}:
        raise ConfigError(f"log_level: {config.log_level!r} is not debug, info, warning or error")
    if config.nvml.events not in NVML_EVENT_MODES:
        raise ConfigError(f"nvml.events: {config.nvml.events!r} is not {', '.join(NVML_EVENT_MODES[:-1])} or none")
    if not 0 <= config.trainer.spares <= 64:
        raise ConfigError(f"trainer.spares: {config.trainer.spares} is out of range (0 to 64)")
    if config.sim.gpus < 1 or config.sim.gpus > 64:
        raise ConfigError(f"sim.gpus: {config.sim.gpus} is out of range (1 to 64)")
    if not 0.0 < config.policy.breaker_max_share <= 1.0:
        raise ConfigError(f"policy.breaker_max_share: {config.policy.breaker_max_share} is not in (0, 1]")
    for name, value in dataclasses.asdict(config.rules).items():
        if name.endswith("_s") and value <= 0:
            raise ConfigError(f"rules.{name}: {value} must be positive")
    if config.policy.repeat_quarantines < 1 or config.policy.repeat_window_s <= 0:
        raise ConfigError("policy.repeat_quarantines must be at least 1 and policy.repeat_window_s positive")
    v = config.validation
    if v.timeout_s <= 0 or not 0.0 <= v.tolerance < 1.0 or v.matmul_tflops < 0 or v.mem_bandwidth_gbps < 0:
        raise ConfigError(
            "validation: timeout_s must be positive, tolerance in [0, 1), matmul_tflops and mem_bandwidth_gbps ≥ 0"
        )
    for name, value in dataclasses.asdict(config.drills).items():
        if name.endswith("_s") and value <= 0:
            raise ConfigError(f"drills.{name}: {value} must be positive")
    _check_durations(config)
    _check_shares(config)
    if known_rules is not None:
        unknown = sorted(set(config.rules.disabled) - set(known_rules))
        if unknown:
            raise ConfigError(
                f"rules.disabled: {', '.join(map(repr, unknown))} is not a rule id or rule module "
                f"(known: {', '.join(sorted(known_rules))})"
            )
    _check_range("expected_gpus", config.expected_gpus, 0, 1024)
    _check_range("slow_interval_s", config.slow_interval_s, 1.0, 86400.0)
    _check_range("findings_retention_days", config.findings_retention_days, 0.01, 36500.0)
    for name in ("state_dir", "runtime_dir"):
        if not str(getattr(config, name)).strip():
            raise ConfigError(f"{name}: must not be empty")
    rules = config.rules
    _check_range("rules.clock_low_ratio", rules.clock_low_ratio, 0.0, 1.0, low_open=True)
    _check_range("rules.power_unstable_drop_ratio", rules.power_unstable_drop_ratio, 0.0, 1.0, low_open=True)
    _check_range("rules.ecc_sbe_per_hour", rules.ecc_sbe_per_hour, 0.0, 1e12, low_open=True)
    _check_range("rules.xid_app_repeats", rules.xid_app_repeats, 1, 1_000_000)
    _check_range("rules.thermal_margin_c", rules.thermal_margin_c, 0, 200)
    trainer = config.trainer
    _check_range("trainer.fragmentation_ratio", trainer.fragmentation_ratio, 0.0, 1.0, low_open=True)
    _check_range("trainer.alloc_retries_per_min", trainer.alloc_retries_per_min, 0.0, 1e9, low_open=True)
    _check_range("trainer.straggler_ratio", trainer.straggler_ratio, 1.0, 1e6, low_open=True)
    _check_range("trainer.grad_var_jump", trainer.grad_var_jump, 1.0, 1e12, low_open=True)
    _check_range("trainer.hang_step_times", trainer.hang_step_times, 0.0, 1e6, low_open=True)
    _check_range("trainer.hang_frozen_step_times", trainer.hang_frozen_step_times, 0.0, 1e6, low_open=True)
    _check_range("rules.pcie_errors_per_hour", rules.pcie_errors_per_hour, 0.0, 1e12, low_open=True)
    _check_range("rules.nvlink_errors_per_hour", rules.nvlink_errors_per_hour, 0.0, 1e12, low_open=True)
    _check_stop_signal(trainer.stop_signal)
    _check_range("api.max_connections", config.api.max_connections, 16, 1_000_000)
    _check_range("api.max_header_bytes", config.api.max_header_bytes, 1024, 1 << 20)
    _check_range("api.max_body_bytes", config.api.max_body_bytes, 1024, 1 << 30)
    _check_api_names(config.api)
    for number, entry in enumerate(config.drills.schedule, start=1):
        _check_range(f"drills.schedule[{number}].require_healthy_share", entry.require_healthy_share, 0.0, 1.0)

    _validate_fleet(config)


# Durations that may be 0 ("at once"); every other `_s` / `_days` setting must be positive.
_ZERO_DURATION_OK = frozenset(
    {
        "policy.quarantine_degraded_after_s",
        "policy.recovery_s",
        "trainer.grace_period_s",
        "trainer.kill_after_s",
        "fleet.cache_s",
    }
)


def _settings(config: Config) -> list[tuple[str, Any]]:
    """(dotted key, value) of every top-level and section setting; [[drills.schedule]] entries are not flattened."""
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.extend((f"{f.name}.{sub.name}", getattr(value, sub.name)) for sub in dataclasses.fields(value))
        else:
            out.append((f.name, value))
    return out


def _check_finite(config: Config) -> None:
    for key, value in _settings(config):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: {value} is not a finite number")


def _check_durations(config: Config) -> None:
    for key, value in _settings(config):
        if not key.endswith(("_s", "_days")) or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value < 0 or (value == 0 and key not in _ZERO_DURATION_OK):
            raise ConfigError(f"{key}: {value} must be {'0 or more' if key in _ZERO_DURATION_OK else 'positive'}")
        if key.endswith("_s") and value > MAX_DURATION_S:
            raise ConfigError(f"{key}: {value} is over ten years ({MAX_DURATION_S:.0f} s)")


def _check_shares(config: Config) -> None:
    """Every percentage (`_pct`) in [0, 100] and every duty (`_duty`, a share of a window) in (0, 1]."""
    for key, value in _settings(config):
        if key.endswith("_pct"):
            _check_range(key, value, 0, 100)
        elif key.endswith("_duty"):
            _check_range(key, value, 0.0, 1.0, low_open=True)


def _check_api_names(api: ApiConfig) -> None:
    """A group name as useradd takes it; Host names as they appear in a Host header (or "*")."""
    if api.admin_group and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}", api.admin_group):
        raise ConfigError(f"api.admin_group: {api.admin_group!r} is not a group name")
    for name in api.allowed_hosts:
        if name != "*" and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,253}", name):
            raise ConfigError(f'api.allowed_hosts: {name!r} is not a host name (or "*" for any)')


def _check_stop_signal(name: str) -> None:
    """A signal the ranks can catch: SIGKILL or SIGSTOP would give them no chance to checkpoint."""
    text = name.strip().upper()
    try:
        sig = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        )
    except (KeyError, ValueError):
        raise ConfigError(f"trainer.stop_signal: {name!r} is not a signal") from None
    if sig.name in UNCATCHABLE_SIGNALS:
        raise ConfigError(f"trainer.stop_signal: {sig.name} cannot be caught, so no rank could checkpoint first")


def _check_range(key: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    """`low <= value <= high` (`low < value` with low_open), else one line naming the key and the range."""
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ConfigError(f"{key}: {value} is out of range {bracket}{low:g}, {high:g}]")


def _validate_fleet(config: Config) -> None:
    """The [slurm] and [fleet] sections."""
    slurm, fleet = config.slurm, config.fleet
    if slurm.drain_on not in {"unhealthy", "any_quarantine", "usable_below"}:
        raise ConfigError(f"slurm.drain_on: {slurm.drain_on!r} is not unhealthy, any_quarantine or usable_below")
    if not 0 <= slurm.min_usable_gpus <= 64:
        raise ConfigError(f"slurm.min_usable_gpus: {slurm.min_usable_gpus} is out of range (0 to 64)")
    if slurm.node_name and not re.fullmatch(r"[\w.\-]+", slurm.node_name):
        raise ConfigError(f"slurm.node_name: {slurm.node_name!r} is not a Slurm node name")
    if slurm.enabled and not slurm.scontrol:
        raise ConfigError("slurm.scontrol: empty")
    for name in ("timeout_s", "retry_max_s", "reconcile_s"):
        if not 0.0 < getattr(slurm, name) <= 86400.0:
            raise ConfigError(f"slurm.{name}: {getattr(slurm, name)} is out of range (0 to 86400 seconds)")
    if fleet.prometheus_url and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", fleet.prometheus_url):
        raise ConfigError(f"fleet.prometheus_url: {fleet.prometheus_url!r} is not an http(s) URL")
    if not 0.0 < fleet.max_quarantined_share <= 1.0:
        raise ConfigError(f"fleet.max_quarantined_share: {fleet.max_quarantined_share} is not in (0, 1]")
    if fleet.max_drained_nodes < 1:
        raise ConfigError(f"fleet.max_drained_nodes: {fleet.max_drained_nodes} must be at least 1")
    if not 1.0 <= fleet.window_s <= 30 * 86400.0:
        raise ConfigError(f"fleet.window_s: {fleet.window_s} is out of range (1 s to 30 days)")
    if not 0.1 <= fleet.timeout_s <= 30.0:
        raise ConfigError(f"fleet.timeout_s: {fleet.timeout_s} is out of range (0.1 to 30 seconds)")
    if not 0.0 <= fleet.cache_s <= 600.0:
        raise ConfigError(f"fleet.cache_s: {fleet.cache_s} is out of range (0 to 600 seconds)")
    if fleet.on_unreachable not in {"open", "closed"}:
        raise ConfigError(f"fleet.on_unreachable: {fleet.on_unreachable!r} is not open or closed")


def _read_toml(path: Path) -> dict[str, Any]:
    """The parsed file: a regular file of at most MAX_CONFIG_BYTES, UTF-8, nested no deeper than tomllib recurses."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not hang the command
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path}: not a regular file: is it the right file?")
        raw = file.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: over {MAX_CONFIG_BYTES} bytes: is it the right file?")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte {exc.start}): is it the right file?") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid TOML: arrays or tables nested too deeply") from None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: Any, data: Mapping[str, Any], source: str, prefix: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source}: [{prefix.rstrip('.')}] must be a table")
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in data.items():
        where = f"{source}: key {prefix}{key}"
        if key not in known:
            raise ConfigError(f"{where}: unknown key (known: {', '.join(sorted(known))})")
        values[key] = _coerce(hints[key], raw, where, from_string=False, prefix=f"{prefix}{key}.", source=source)
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{source}: [{prefix.rstrip('.')}] {exc}") from None


def _coerce(hint: Any, raw: Any, where: str, *, from_string: bool, prefix: str = "", source: str = "") -> Any:
    """Turn a TOML value (or an environment string) into the field's type, or raise ConfigError."""
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, raw, source, prefix)
    if origin is tuple:
        item_hint = typing.get_args(hint)[0]
        if from_string:
            raw = [part.strip() for part in str(raw).split(",") if part.strip()]
        if not isinstance(raw, list):
            raise ConfigError(f"{where}: expected a list, got {raw!r}")
        return tuple(
            _coerce(item_hint, item, where, from_string=from_string, prefix=prefix, source=source) for item in raw
        )
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _coerce(options[0], raw, where, from_string=from_string)
    if hint is bool:
        if (
            from_string
            and isinstance(raw, str)
            and raw.lower() in {"1", "true", "yes", "on", "0", "false", "no", "off"}
        ):
            return raw.lower() in {"1", "true", "yes", "on"}
        if isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: expected true or false, got {raw!r}")
    if hint is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{where}: expected an integer, got {raw!r}")
        try:
            if isinstance(raw, int) or from_string:
                return int(raw)
        except ValueError:
            pass
        raise ConfigError(f"{where}: expected an integer, got {raw!r}")
    if hint is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{where}: expected a number, got {raw!r}")
        try:
            if isinstance(raw, (int, float)) or from_string:
                return float(raw)
        except ValueError:
            pass
        raise ConfigError(f"{where}: expected a number, got {raw!r}")
    if hint is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"{where}: expected a string, got {raw!r}")
    raise ConfigError(f"{where}: unsupported setting type {hint!r}")  # pragma: no cover


def _apply_env(config: Config, environ: Mapping[str, str], given: dict[str, str]) -> Config:
    """Apply GPUWATCH_* variables; `given` (dotted key → where it was set) records each one."""
    names = {}
    section_types = sections()
    for f in dataclasses.fields(Config):
        if f.name in section_types:
            for sub in dataclasses.fields(section_types[f.name]):
                if sub.name != "schedule":
                    names[f"{ENV_PREFIX}{f.name}_{sub.name}".upper()] = f"{f.name}.{sub.name}"
        else:
            names[f"{ENV_PREFIX}{f.name}".upper()] = f.name
    for var, dotted in names.items():
        if var in environ:
            config = _set_dotted(config, dotted, environ[var], f"environment variable {var}", from_string=True)
            given[dotted] = f"from environment variable {var}"
    return config


def _set_dotted(config: Config, dotted: str, value: Any, where: str, from_string: bool = False) -> Config:
    head, _, tail = dotted.partition(".")
    if tail:
        section = getattr(config, head)
        hint = _hints(type(section))[tail]
        coerced = _coerce(hint, value, where, from_string=from_string or isinstance(value, str))
        return dataclasses.replace(config, **{head: dataclasses.replace(section, **{tail: coerced})})
    hint = _hints(Config)[head]
    coerced = _coerce(hint, value, where, from_string=from_string or isinstance(value, str))
    return dataclasses.replace(config, **{head: coerced})


def sections() -> dict[str, Any]:
    """Section name → dataclass, for the example config test and docs."""
    return {name: hint for name, hint in _hints(Config).items() if dataclasses.is_dataclass(hint)}
