"""A small fake of the DCGM Python bindings (dcgm_agent, dcgm_structs, dcgm_fields) for DcgmBackend tests.

Only the surface DcgmBackend uses: init, connect or embed, a default group, one field group, a
watch, and dcgmEntityGetLatestValues returning dcgmFieldValue_v1-shaped objects. A field that is not
watched answers DCGM_ST_NOT_WATCHED, as the real cache does, so tests prove every read field is
watched. Values are given in DCGM's units (W, MiB, µs timestamps); a Python float is a double
field, an int an int64 field, a str a string field.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from gpuwatch.backends.dcgm import DcgmBindings

DCGM_ST_OK = 0
DCGM_ST_NOT_SUPPORTED = -6
DCGM_ST_NOT_WATCHED = -16
DCGM_ST_GPU_IS_LOST = -18
DCGM_ST_RESET_REQUIRED = -19
DCGM_ST_CONNECTION_NOT_VALID = -21
DCGM_ST_LIBRARY_NOT_FOUND = -25

# ref. dcgmvalue.py
DCGM_INT32_NOT_SUPPORTED = 0x7FFFFFF0 + 2
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_INT64_NOT_SUPPORTED = DCGM_INT64_BLANK + 2
DCGM_FP64_BLANK = 140737488355328.0
DCGM_STR_NOT_SUPPORTED = "<<<NOT_SUPPORTED>>>"


class DCGMError(Exception):
    """dcgm_structs.DCGMError: the DCGM status is `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return f"DCGM error {self.value}"


class ConnectParams:
    """dcgm_structs.c_dcgmConnectV2Params_v2 (plain attributes instead of ctypes fields)."""

    version = 0
    persistAfterDisconnect = 0
    timeoutMs = 0
    addressIsUnixSocket = 0


def h200_fields(nvml_index: int = 0, uuid: str = "GPU-cc1b419f-1257-3993-729d-08492b313adb") -> dict[int, Any]:
    """An H200 under load, as DCGM reports it: every field DcgmBackend reads."""
    return {
        50: "NVIDIA H200",
        52: nvml_index,
        54: uuid,
        57: f"00000000:00:0{6 + nvml_index}.0",
        113: 1980,
        114: 3201,
        151: 95,
        152: 87,
        158: 89,
        159: 95,
        164: 700.0,
        250: 143771,
        100: 1425,
        101: 3201,
        112: 0x4,
        140: 66,
        150: 61,
        155: 690.123,
        156: 47746405,
        157: 689.5,
        190: 0,
        202: 7,
        203: 100,
        204: 45,
        240: 61100084832,
        241: 12,
        252: 615,
        310: 1,
        311: 2,
        312: 3,
        313: 4,
        393: 6,
        394: 5,
        395: 1,
        396: 0,
        230: DCGM_INT64_BLANK,
    }


@dataclass
class FakeDcgmGpu:
    """One GPU in the fake host engine's cache: values, per-field statuses and timestamps (µs)."""

    values: dict[int, Any] = field(default_factory=h200_fields)
    status: dict[int, int] = field(default_factory=dict)
    ts: dict[int, int] = field(default_factory=dict)
    read_error: int | None = None


class FakeDcgm:
    """The fake host engine and its bindings; `bindings()` gives what DcgmBackend(dcgm=...) takes."""

    def __init__(self, gpus: dict[int, FakeDcgmGpu] | None = None) -> None:
        self.gpus = gpus if gpus is not None else {0: FakeDcgmGpu(), 1: FakeDcgmGpu(h200_fields(1, "GPU-5fa0c5b1"))}
        self.calls: Counter[str] = Counter()
        self.library_error: int | None = None
        self.hostengine_running = False
        self.watched: set[int] = set()
        self.watch_args: tuple[Any, ...] = ()
        self.live_groups: set[str] = set()
        self.embedded = False
        self.connected = False
        self.init_count = 0

    def bindings(self) -> DcgmBindings:
        structs = SimpleNamespace(
            DCGMError=DCGMError,
            c_dcgmConnectV2Params_v2=ConnectParams,
            DCGM_GROUP_DEFAULT=0,
            DCGM_OPERATION_MODE_AUTO=1,
            _dcgmInit=self._dcgm_init,
            **{name: value for name, value in globals().items() if name.startswith("DCGM_ST_")},
        )
        fields = SimpleNamespace(DCGM_FE_GPU=1, DCGM_FT_DOUBLE="d", DCGM_FT_INT64="i", DCGM_FT_STRING="s")
        return DcgmBindings(agent=self, structs=structs, fields=fields)

    def set_xid(self, gpu_id: int, xid: int, ts_us: int) -> None:
        """Record an XID in the cache as the host engine does when NVML delivers one."""
        self.gpus[gpu_id].values[230] = xid
        self.gpus[gpu_id].ts[230] = ts_us

    def _count(self, name: str) -> None:
        self.calls[name] += 1

    def _dcgm_init(self) -> None:
        self._count("_dcgmInit")
        if self.library_error is not None:
            raise DCGMError(self.library_error)

    def dcgmInit(self) -> None:
        self._count("dcgmInit")
        self.init_count += 1

    def dcgmShutdown(self) -> None:
        self._count("dcgmShutdown")
        self.init_count -= 1

    def dcgmConnect_v2(self, address: str, params: ConnectParams) -> str:
        self._count("dcgmConnect_v2")
        if not self.hostengine_running:
            raise DCGMError(DCGM_ST_CONNECTION_NOT_VALID)
        self.connected = True
        return f"tcp:{address}"

    def dcgmDisconnect(self, handle: str) -> None:
        self._count("dcgmDisconnect")
        self.connected = False

    def dcgmStartEmbedded(self, mode: int) -> str:
        self._count("dcgmStartEmbedded")
        self.embedded = True
        return "embedded"

    def dcgmStopEmbedded(self, handle: str) -> None:
        self._count("dcgmStopEmbedded")
        self.embedded = False

    def dcgmGetAllSupportedDevices(self, handle: str) -> list[int]:
        self._count("dcgmGetAllSupportedDevices")
        return list(self.gpus)

    def dcgmGroupCreate(self, handle: str, group_type: int, name: str) -> str:
        self._count("dcgmGroupCreate")
        self.live_groups.add(f"group:{name}")
        return f"group:{name}"

    def dcgmGroupDestroy(self, handle: str, group: str) -> None:
        self._count("dcgmGroupDestroy")
        self.live_groups.discard(group)

    def dcgmFieldGroupCreate(self, handle: str, field_ids: list[int], name: str) -> tuple[str, tuple[int, ...]]:
        self._count("dcgmFieldGroupCreate")
        self.live_groups.add(f"fields:{name}")
        return (f"fields:{name}", tuple(field_ids))

    def dcgmFieldGroupDestroy(self, handle: str, field_group: tuple[str, tuple[int, ...]]) -> None:
        self._count("dcgmFieldGroupDestroy")
        self.live_groups.discard(field_group[0])

    def dcgmWatchFields(self, handle: str, group: str, field_group: Any, freq_us: int, age_s: float, n: int) -> None:
        self._count("dcgmWatchFields")
        self.watched.update(field_group[1])
        self.watch_args = (freq_us, age_s, n)

    def dcgmUpdateAllFields(self, handle: str, wait: int) -> None:
        self._count("dcgmUpdateAllFields")

    def dcgmEntityGetLatestValues(self, handle: str, entity_group: int, gpu_id: int, field_ids: list[int]) -> list[Any]:
        """dcgmFieldValue_v1 per field, in the order asked."""
        self._count("dcgmEntityGetLatestValues")
        gpu = self.gpus[gpu_id]
        if gpu.read_error is not None:
            raise DCGMError(gpu.read_error)
        return [self._value(gpu, field_id) for field_id in field_ids]

    def _value(self, gpu: FakeDcgmGpu, field_id: int) -> SimpleNamespace:
        raw = gpu.values.get(field_id, DCGM_INT64_NOT_SUPPORTED)
        status = DCGM_ST_NOT_WATCHED if field_id not in self.watched else gpu.status.get(field_id, DCGM_ST_OK)
        if isinstance(raw, str):
            kind, union = "s", SimpleNamespace(str=raw.encode())
        elif isinstance(raw, float):
            kind, union = "d", SimpleNamespace(dbl=raw)
        else:
            kind, union = "i", SimpleNamespace(i64=raw)
        ts = gpu.ts.get(field_id, 1_796_037_709_000_000)
        return SimpleNamespace(version=1, fieldId=field_id, fieldType=ord(kind), status=status, ts=ts, value=union)
