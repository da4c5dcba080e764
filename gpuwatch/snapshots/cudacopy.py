"""Copies on a CUDA stream issued straight through the CUDA runtime torch loaded: microseconds a call.

A staged snapshot issues its copies on the training thread while the GPU waits for the loop's next
launches: one per tensor at the boundary, one per registered piece of the slot as it drains. torch's
`copy_` costs tens of microseconds a call there (two views made, the dispatcher, its checks): on an
H200 the copies of a 16 GiB state added milliseconds to every step a snapshot drained in. Here a copy
is one `cudaMemcpyAsync` through ctypes. Where the process has no shared CUDA runtime to call (a torch
built with it linked in), or a call fails (said once in the log, CUDA's error cleared), the copies go
through torch as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("gpuwatch.snapshots")

_DEFAULT = 4  # cudaMemcpyDefault: the runtime tells host from device by the pointers (unified addressing)
_RUNTIME: list[Any] = []  # [the runtime, or None when there is none to call]


def runtime() -> Any:
    """The CUDA runtime library already loaded in this process (torch's), or None."""
    if not _RUNTIME:
        _RUNTIME.append(_load())
    return _RUNTIME[0]


def _load() -> Any:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
            function = library.cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        function.restype = ctypes.c_int
        return library
    return None


class StreamCopier:
    """Copies between raw addresses on one CUDA stream (the training thread's current device must be its device)."""

    def __init__(self, stream: Any) -> None:
        self._stream = ctypes.c_void_p(int(stream.cuda_stream))
        library = runtime()
        self._memcpy: Any = library.cudaMemcpyAsync if library is not None else None

    def copy(self, dst: int, src: int, nbytes: int, fallback: Callable[[], Any]) -> None:
        """Queue a copy of `nbytes` from address `src` to `dst`; `fallback` does the same with torch."""
        if self._memcpy is not None:
            code = self._memcpy(dst, src, nbytes, _DEFAULT, self._stream)
            if code == 0:
                return
            self._fail(code)
        fallback()

    def _fail(self, code: int) -> None:
        library = runtime()
        with contextlib.suppress(Exception):
            library.cudaGetLastError()  # the job's next CUDA call must not see this error
        log.warning("cudaMemcpyAsync failed (CUDA error %d): snapshot copies go through torch", code)
        self._memcpy = None
