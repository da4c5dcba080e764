"""NVML calls bound once per GPU: the C function, its arguments and its output buffer made ready at open().

pynvml's wrapper for each call looks the C function up, allocates the output, converts the arguments
and checks the return code, all in Python, every call; nvmlDeviceGetFieldValues also builds a ctypes
array and decodes each result through ctypes structures. On the H200's host core that work cost about
as much as NVML itself for the cheap per-sample reads (docs/performance.md). A bound call pays only
the C call and the read of its output; a field-value batch is decoded from its bytes in one pass.

Each binder returns None where it cannot bind (a binding without the C function table, a driver
without the function, a structure whose layout is not the one decoded here): the caller then uses
pynvml's wrapper, which answers the same (an error the wrapper would raise, the bound call raises too).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

# ref. nvml.h nvmlFieldValue_t: fieldId, scopeId (uint), timestamp, latencyUsec (long long),
# valueType (nvmlValueType_t), nvmlReturn (nvmlReturn_t), value (nvmlValue_t, 8 bytes).
_FIELD_VALUE = struct.Struct("<IIqqIIQ")
_FIELD_OFFSETS = (
    ("fieldId", 0),
    ("scopeId", 4),
    ("timestamp", 8),
    ("latencyUsec", 16),
    ("valueType", 24),
    ("nvmlReturn", 28),
    ("value", 32),
)
# ref. nvml.h nvmlValueType_t: 0 double, 1 uint, 2 ulong, 3 ulonglong, 4 signed long long, 5 int, 6 ushort.
_DOUBLE, _UINT, _SIGNED_LONG_LONG, _INT, _USHORT = 0, 1, 4, 5, 6

Read = Callable[[], Any]
FieldResults = list[tuple[int, int | float | None]]  # per field asked: (NVML return, value or None)


def bind(nvml: Any, name: str, handle: Any, *args: Any, out: Any = ctypes.c_uint) -> Read | None:
    """`name(handle, *args, &out)` as one call returning the output's value (a structure: the structure itself,
    overwritten by the next call, so read it at once); None where it cannot bind.

    Raises (from the call): nvml.NVMLError with the C return code, as pynvml's wrapper would.
    """
    fn = _function(nvml, name)
    if fn is None or out is None:
        return None
    buffer = out()
    full = (handle, *args, ctypes.byref(buffer))
    error = nvml.NVMLError
    if issubclass(out, ctypes.Structure):

        def read_struct() -> Any:
            code = fn(*full)
            if code:
                raise error(code)
            return buffer

        return read_struct

    def read_value() -> Any:
        code = fn(*full)
        if code:
            raise error(code)
        return buffer.value

    return read_value


def bind_field_values(nvml: Any, handle: Any, field_ids: Sequence[int]) -> Callable[[], FieldResults] | None:
    """nvmlDeviceGetFieldValues for `field_ids`, the array built once; each result as (return code, value)."""
    fn = _function(nvml, "nvmlDeviceGetFieldValues")
    value_type = getattr(nvml, "c_nvmlFieldValue_t", None)
    if fn is None or value_type is None or not _decodable(value_type):
        return None
    count = len(field_ids)
    array = (value_type * count)()
    for slot, field_id in zip(array, field_ids, strict=True):
        slot.fieldId = field_id
    pointer = ctypes.byref(array)
    error = nvml.NVMLError

    def read() -> FieldResults:
        code = fn(handle, count, pointer)
        if code:
            raise error(code)
        return [
            (ret, None if ret else _value(kind, raw)) for _, _, _, _, kind, ret, raw in _FIELD_VALUE.iter_unpack(array)
        ]

    return read


def bind_field(nvml: Any, handle: Any, field_id: int) -> Read | None:
    """One field through nvmlDeviceGetFieldValues as a call returning its value; a field's own NVML return
    other than success raises, as a call's would (NOT_SUPPORTED: the GPU lacks the field)."""
    batch = bind_field_values(nvml, handle, [field_id])
    if batch is None:
        return None
    error = nvml.NVMLError

    def read() -> int | float | None:
        ((code, value),) = batch()
        if code:
            raise error(code)
        return value

    return read


def _value(kind: int, raw: int) -> int | float:
    """The nvmlValue_t union's member that `kind` names, from its 8 bytes read as an unsigned 64-bit integer."""
    if kind == _UINT:
        return raw & 0xFFFFFFFF
    if kind == _DOUBLE:
        return float(struct.unpack("<d", raw.to_bytes(8, "little"))[0])
    if kind == _SIGNED_LONG_LONG:
        return raw - (1 << 64) if raw >= 1 << 63 else raw
    if kind == _INT:
        low = raw & 0xFFFFFFFF
        return low - (1 << 32) if low >= 1 << 31 else low
    if kind == _USHORT:
        return raw & 0xFFFF
    return raw  # unsigned long (64-bit on Linux), unsigned long long


def _decodable(value_type: Any) -> bool:
    """Whether the binding's nvmlFieldValue_t has the layout _FIELD_VALUE decodes."""
    try:
        offsets = tuple((name, getattr(value_type, name).offset) for name, _ in _FIELD_OFFSETS)
    except AttributeError:
        return False
    return ctypes.sizeof(value_type) == _FIELD_VALUE.size and offsets == _FIELD_OFFSETS


def _function(nvml: Any, name: str) -> Any:
    """The C function from pynvml's table, or None (no table, or the driver lacks it)."""
    lookup = getattr(nvml, "_nvmlGetFunctionPointer", None)
    if lookup is None:
        return None
    try:
        return lookup(name)
    except nvml.NVMLError:
        return None
