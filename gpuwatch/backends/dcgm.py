"""The DCGM backend: reads GPUs from a DCGM host engine's field cache through DCGM's own bindings.

DCGM's Python bindings ship with DCGM, not on PyPI (docs/hardware-facts.md §DCGM), so open() puts the configured
binding folders (`tools.dcgm_bindings`) on sys.path and imports them only then. It connects to a
standalone nv-hostengine on localhost when one runs and otherwise starts an embedded host engine in
this process (docs/hardware-facts.md §DCGM). Fields are named by numeric id only: DCGM 4.6 renamed the identifiers
but kept the ids (dcgm_fields.h). Every DCGMError is mapped once, in `_map_error`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from gpuwatch.config import Config
from gpuwatch.errors import BackendUnavailable, GpuReadError
from gpuwatch.model import GpuError, GpuEvent, GpuSample, GpuStatic

log = logging.getLogger("gpuwatch.backends.dcgm")

# ref. dcgm_fields.h (docs/hardware-facts.md §DCGM): GpuSample field -> DCGM field id.
SAMPLE_FIELDS: dict[str, int] = {
    "sm_clock_mhz": 100,
    "mem_clock_mhz": 101,
    "clocks_event_reasons": 112,
    "mem_temp_c": 140,
    "temp_c": 150,
    "power_w": 155,  # double, W
    "energy_mj": 156,
    "power_instant_mw": 157,  # double, W
    "pstate": 190,
    "pcie_replay": 202,
    "util_gpu_pct": 203,
    "util_mem_pct": 204,
    "violation_power_ns": 240,  # ns since DCGM 4.1 (dcgm_fields.h)
    "violation_thermal_ns": 241,
    "memory_used_bytes": 252,  # MiB
    "ecc_sbe_volatile": 310,
    "ecc_dbe_volatile": 311,
    "ecc_sbe_aggregate": 312,
    "ecc_dbe_aggregate": 313,
    "remapped_unc": 393,
    "remapped_cor": 394,
    "remapped_failure": 395,
    "remapped_pending": 396,
    "pcie_link_gen": 237,
    "pcie_link_width": 238,
    "nvlink_crc_errors": 409,  # all links
    "nvlink_recovery_errors": 439,
    "pcie_correctable_errors": 1501,  # DCGM 4.4.2+
    "recovery_action": 1523,  # DCGM 4.5+ (not DCGM's 230, which is the XID)
}
# ref. dcgm_fields.h: GpuStatic field (plus the NVML index) -> DCGM field id, read once at open.
STATIC_FIELDS: dict[str, int] = {
    "name": 50,
    "nvml_index": 52,
    "uuid": 54,
    "pci_bus_id": 57,
    "max_sm_clock_mhz": 113,
    "max_mem_clock_mhz": 114,
    "mem_max_temp_c": 151,
    "gpu_max_temp_c": 152,
    "slowdown_temp_c": 158,
    "shutdown_temp_c": 159,
    "power_limit_w": 164,  # enforced limit, W
    "memory_total_bytes": 250,  # MiB
    "pcie_link_gen_max": 235,
    "pcie_link_width_max": 236,
}
# ref. dcgm_fields.h: the value is the XID number of the latest XID, not a count.
XID_FIELD = 230

# ref. dcgm_structs.h / dcgmvalue.py: values at or above a BLANK are sentinels,
# the int32 ones (BLANK..BLANK+3) can also arrive in int64 fields.
_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
_INT32_BLANK = 0x7FFFFFF0
_FP64_BLANK = 140737488355328.0
_MIB = 1024 * 1024
_MAX_PSTATE = 15
# ref. dcgm_structs.h DCGM_HE_PORT_NUMBER: nv-hostengine listens on 127.0.0.1:5555 by default.
_HOSTENGINE = "127.0.0.1"
_CONNECT_TIMEOUT_MS = 1000
_XID_POLL_S = 0.5


class DcgmBindings(NamedTuple):
    """The three binding modules this backend uses; tests pass fakes of the same shape."""

    agent: Any  # dcgm_agent
    structs: Any  # dcgm_structs
    fields: Any  # dcgm_fields


@dataclass
class _Gpu:
    """One DCGM GPU: its DCGM id, static facts, and the timestamp of the last XID seen."""

    gpu_id: int
    static: GpuStatic
    xid_ts: int = 0


class DcgmBackend:
    """Reads GPUs through DCGM. Constructed cheaply; nothing is touched until open().

    Like NvmlBackend it offers `release_handles()` and `reacquire()` for reset drills (an embedded
    host engine holds NVML, which blocks a GPU reset).

    Args:
        config: `interval_s` sets the watch frequency; `tools.dcgm_bindings` where the bindings live.
        dcgm: the binding modules, for tests; None imports them in open().
    """

    name = "dcgm"

    def __init__(self, config: Config, dcgm: DcgmBindings | None = None) -> None:
        self._config = config
        self._dcgm = dcgm
        self._lock = threading.Lock()
        self._initialized = False
        self._handle: Any = None
        self._embedded = False
        self._group: Any = None
        self._field_group: Any = None
        self._gpus: dict[int, _Gpu] = {}
        self._failing: set[int] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> tuple[GpuStatic, ...]:
        """Connect to (or start) a host engine, watch one field group, and read each GPU's static facts.

        Raises:
            BackendUnavailable: the bindings or libdcgm are missing, or DCGM finds no GPU.
        """
        dcgm = self._load()
        agent, structs = dcgm.agent, dcgm.structs
        interval_s = self._config.interval_s
        ids = sorted({*SAMPLE_FIELDS.values(), *STATIC_FIELDS.values(), XID_FIELD})
        name = f"gpuwatch-{os.getpid()}"
        try:
            # ref. DcgmHandle.__init__: load libdcgm, initialise the client, then connect or embed.
            with self._lock:
                structs._dcgmInit()
                agent.dcgmInit()
                self._initialized = True
                self._handle = self._connect(dcgm)
                gpu_ids = agent.dcgmGetAllSupportedDevices(self._handle)
                if not gpu_ids:
                    raise BackendUnavailable("DCGM found no supported GPU")
                self._group = agent.dcgmGroupCreate(self._handle, structs.DCGM_GROUP_DEFAULT, name)
                self._field_group = agent.dcgmFieldGroupCreate(self._handle, ids, name)
                # Keep a few intervals of history; only the latest value is ever read.
                max_keep_age_s = max(60.0, 4 * interval_s)
                agent.dcgmWatchFields(
                    self._handle, self._group, self._field_group, int(interval_s * 1e6), max_keep_age_s, 0
                )
                # ref. DcgmGroup.WatchFields: without this the first reads find no value yet.
                agent.dcgmUpdateAllFields(self._handle, 1)
                gpus = [self._discover(gpu_id) for gpu_id in gpu_ids]
                self._gpus = {gpu.static.index: gpu for gpu in gpus}
                self._failing = set()
        except structs.DCGMError as exc:
            self.close()
            raise BackendUnavailable(f"DCGM is not usable: {exc}") from None
        except BackendUnavailable:
            self.close()
            raise
        return tuple(gpu.static for gpu in gpus)

    def close(self) -> None:
        """Drop the field group and group, disconnect or stop the embedded engine. Safe to call twice."""
        with self._lock:
            if self._dcgm is None or not self._initialized:
                return
            agent, handle = self._dcgm.agent, self._handle
            group, field_group = self._group, self._field_group
            self._initialized, self._handle, self._group, self._field_group, self._gpus = False, None, None, None, {}
            steps: list[tuple[str, Callable[[], Any]]] = []
            if field_group is not None:
                steps.append(("dcgmFieldGroupDestroy", lambda: agent.dcgmFieldGroupDestroy(handle, field_group)))
            if group is not None:
                steps.append(("dcgmGroupDestroy", lambda: agent.dcgmGroupDestroy(handle, group)))
            if handle is not None and self._embedded:
                steps.append(("dcgmStopEmbedded", lambda: agent.dcgmStopEmbedded(handle)))
            elif handle is not None:
                steps.append(("dcgmDisconnect", lambda: agent.dcgmDisconnect(handle)))
            steps.append(("dcgmShutdown", agent.dcgmShutdown))
            for step, call in steps:
                try:
                    call()
                except self._dcgm.structs.DCGMError as exc:
                    log.debug("%s failed while closing: %s", step, exc)

    def release_handles(self) -> None:
        """Let go of DCGM (and so of NVML in an embedded engine) before a GPU reset. Safe to call twice."""
        self.close()

    def reacquire(self) -> tuple[GpuStatic, ...]:
        """Open DCGM again after release_handles().

        Raises:
            BackendUnavailable: DCGM does not come back.
        """
        self.close()
        return self.open()

    # -- sampling ----------------------------------------------------------------------------

    def sample(self, index: int, now: float, *, slow: bool = False) -> GpuSample:
        """Read one GPU's latest cached values in one call.

        `slow` is accepted and ignored: the host engine samples every watched field on its own
        schedule, so the costly fields cost nothing extra to read here.

        Args:
            index: the GPU's NVML index (as in its GpuStatic).
            now: the sample's timestamp (Unix seconds), supplied by the caller.
            slow: ignored (see above).

        Raises:
            GpuReadError: this GPU failed (kind gpu_lost, reset_required or unknown).
        """
        gpu = self._gpus.get(index)
        if gpu is None or self._handle is None:
            raise GpuReadError("unknown", f"no open DCGM GPU with index {index}")
        with self._mapped():
            values = self._latest(gpu.gpu_id, SAMPLE_FIELDS)
        pstate = values.pop("pstate")
        return GpuSample(
            t=now,
            index=index,
            uuid=gpu.static.uuid,
            pstate=pstate if pstate is not None and pstate <= _MAX_PSTATE else None,
            **values,
        )

    def wait_events(self, timeout_s: float) -> list[GpuEvent | GpuError]:
        """Poll field 230 for new XIDs until one arrives or `timeout_s` passes.

        The host engine records an XID as its NVML event arrives (DcgmCacheManager.cpp); a new timestamp on
        the latest value is a new XID. Two XIDs on one GPU within one poll show as the later one.
        A GPU that cannot be read is reported once as a GpuError until it reads again.
        """
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self._lock:
                items = self._poll_xids() if self._handle is not None else []
            remaining = deadline - time.monotonic()
            if items or remaining <= 0:
                return items
            time.sleep(min(_XID_POLL_S, remaining))

    # -- helpers -----------------------------------------------------------------------------

    def _load(self) -> DcgmBindings:
        """The binding modules, importing them from the configured folders on first use."""
        if self._dcgm is not None:
            return self._dcgm
        folders = self._config.tools.dcgm_bindings
        for folder in folders:
            if os.path.isdir(folder) and folder not in sys.path:
                sys.path.append(folder)
        try:
            import dcgm_agent
            import dcgm_fields
            import dcgm_structs
        except ImportError as exc:
            where = ", ".join(folders) or "no folder configured"
            raise BackendUnavailable(f"DCGM Python bindings not importable ({exc}; looked in {where})") from None
        self._dcgm = DcgmBindings(agent=dcgm_agent, structs=dcgm_structs, fields=dcgm_fields)
        return self._dcgm

    def _connect(self, dcgm: DcgmBindings) -> Any:
        """A handle to nv-hostengine on localhost if it answers, else to a new embedded host engine."""
        params = dcgm.structs.c_dcgmConnectV2Params_v2()
        params.persistAfterDisconnect = 0
        params.timeoutMs = _CONNECT_TIMEOUT_MS
        params.addressIsUnixSocket = 0
        try:
            handle = dcgm.agent.dcgmConnect_v2(_HOSTENGINE, params)
        except dcgm.structs.DCGMError as exc:
            log.info("no nv-hostengine at %s (%s); starting an embedded DCGM host engine", _HOSTENGINE, exc)
        else:
            self._embedded = False
            log.info("connected to nv-hostengine at %s", _HOSTENGINE)
            return handle
        self._embedded = True
        return dcgm.agent.dcgmStartEmbedded(dcgm.structs.DCGM_OPERATION_MODE_AUTO)

    def _discover(self, gpu_id: int) -> _Gpu:
        """Static facts and the XID baseline of one GPU (older XIDs are history, not events)."""
        try:
            with self._mapped():
                facts = self._latest(gpu_id, STATIC_FIELDS)
                _, xid_ts = self._latest_xid(gpu_id)
        except GpuReadError as exc:
            log.warning("DCGM GPU %d cannot be read at start: %s", gpu_id, exc)
            return _Gpu(gpu_id=gpu_id, static=GpuStatic(index=gpu_id, uuid=""))
        nvml_index = facts.pop("nvml_index")
        facts = {key: value for key, value in facts.items() if value is not None}
        static = GpuStatic(index=gpu_id if nvml_index is None else nvml_index, **{"uuid": "", **facts})
        return _Gpu(gpu_id=gpu_id, static=static, xid_ts=xid_ts)

    def _poll_xids(self) -> list[GpuEvent | GpuError]:
        items: list[GpuEvent | GpuError] = []
        for gpu in self._gpus.values():
            index, uuid = gpu.static.index, gpu.static.uuid
            try:
                with self._mapped():
                    xid, ts = self._latest_xid(gpu.gpu_id)
            except GpuReadError as exc:
                if index not in self._failing:
                    self._failing.add(index)
                    items.append(GpuError(t=time.time(), index=index, uuid=uuid, kind=exc.kind, detail=exc.detail))
                continue
            self._failing.discard(index)
            if ts != gpu.xid_ts:
                gpu.xid_ts = ts
                if xid is not None:
                    items.append(GpuEvent(t=ts / 1e6, index=index, uuid=uuid, kind="xid", xid=int(xid)))
        return items

    def _latest_xid(self, gpu_id: int) -> tuple[Any, int]:
        """The latest XID value (None when blank) and its timestamp in µs."""
        dcgm = self._bindings()
        (value,) = dcgm.agent.dcgmEntityGetLatestValues(self._handle, dcgm.fields.DCGM_FE_GPU, gpu_id, [XID_FIELD])
        return self._decode(value), value.ts

    def _latest(self, gpu_id: int, fields: dict[str, int]) -> dict[str, Any]:
        """The latest cached value of each named field, converted to gpuwatch units; sentinels are None."""
        dcgm = self._bindings()
        ids = list(fields.values())
        values = dcgm.agent.dcgmEntityGetLatestValues(self._handle, dcgm.fields.DCGM_FE_GPU, gpu_id, ids)
        return {name: _convert(name, self._decode(value)) for name, value in zip(fields, values, strict=True)}

    def _decode(self, value: Any) -> int | float | str | None:
        """A dcgmFieldValue_v1 as a Python value, or None for a per-field error or a blank sentinel."""
        dcgm = self._bindings()
        structs, fields = dcgm.structs, dcgm.fields
        if value.status != structs.DCGM_ST_OK:
            if value.status in (structs.DCGM_ST_GPU_IS_LOST, structs.DCGM_ST_RESET_REQUIRED):
                raise structs.DCGMError(value.status)
            return None
        if value.fieldType == ord(fields.DCGM_FT_DOUBLE):
            number = float(value.value.dbl)
            return None if number >= _FP64_BLANK else number
        if value.fieldType == ord(fields.DCGM_FT_INT64):
            integer = int(value.value.i64)
            blank = integer >= _INT64_BLANK or _INT32_BLANK <= integer <= _INT32_BLANK + 3
            return None if blank else integer
        if value.fieldType == ord(fields.DCGM_FT_STRING):
            text = value.value.str
            text = text.decode() if isinstance(text, bytes) else str(text)
            return None if text.startswith("<<<") and text.endswith(">>>") else text
        return None

    def _bindings(self) -> DcgmBindings:
        if self._dcgm is None:
            raise GpuReadError("unknown", "DCGM bindings are not loaded")
        return self._dcgm

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[None]:
        """Turn any DCGMError raised inside into a GpuReadError (the one place errors are mapped)."""
        dcgm = self._bindings()
        try:
            yield
        except dcgm.structs.DCGMError as exc:
            raise _map_error(dcgm.structs, exc) from exc


def _map_error(structs: Any, exc: BaseException) -> GpuReadError:
    """The trace format's error kind for a DCGM status (ref. dcgm_structs.h dcgmReturn_t)."""
    code = getattr(exc, "value", None)
    if code == structs.DCGM_ST_GPU_IS_LOST:
        return GpuReadError("gpu_lost", str(exc))
    if code == structs.DCGM_ST_RESET_REQUIRED:
        return GpuReadError("reset_required", str(exc))
    return GpuReadError("unknown", str(exc))


def _convert(name: str, value: int | float | str | None) -> Any:
    """DCGM units to gpuwatch's: W stays W (power_instant to mW), MiB to bytes, the rest as is."""
    if value is None or isinstance(value, str):
        return value
    if name in ("power_w", "power_limit_w"):
        return float(value)
    if name == "power_instant_mw":
        return round(float(value) * 1000)
    if name in ("memory_used_bytes", "memory_total_bytes"):
        return int(value) * _MIB
    return int(value)
