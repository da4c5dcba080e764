"""The exception tree of gpuwatch (stdlib only).

    GpuwatchError
    ├── ConfigError          bad config file, variable or flag (exit 2, one line)
    ├── TraceError           malformed trace file (exit 2, one line)
    ├── BackendError         a backend could not do what was asked
    │   ├── BackendUnavailable   the library or driver is not there
    │   └── GpuReadError         one GPU failed a read; `kind` is gpu_lost | reset_required | unknown
    ├── StoreError           the SQLite state could not be read or written
    ├── DaemonError          the CLI could not reach or use the running daemon
    ├── JobError             gpuwatch gave up on something in a training job: one `except JobError` catches it
    │   ├── InPlaceError         recovery in place: NotInPlace, SecretError, StoreAuthError, GroupProofError,
    │   │                        HeaderError (gpuwatch.inplace)
    │   ├── SnapshotError        host snapshots: SnapshotDirError, LayoutChanged (gpuwatch.snapshots)
    │   ├── CheckpointError      no checkpoint verifies, or one could not be written; FlatFileError
    │   └── ReportsUnreachable   the daemon's report socket refused a rank (gpuwatch.trainer.channel)
    ├── DrillError           a drill could not run (guard refused, tool missing)
    └── ServiceError         `gpuwatch service` could not install, uninstall or copy what a node needs

Vendor errors (pynvml, DCGM) are mapped into these at the backend boundary, once. The job side's errors
live beside the code that raises them and keep the builtin base their callers catch (NotInPlace is still a
RuntimeError, SecretError a ValueError, StoreAuthError a ConnectionError).
"""

from __future__ import annotations


class GpuwatchError(Exception):
    """Base of every error gpuwatch raises on purpose."""


class ConfigError(GpuwatchError):
    """A config file, environment variable or flag is wrong; the message names where."""


class TraceError(GpuwatchError):
    """A trace file is malformed; the message names the file and line."""


class BackendError(GpuwatchError):
    """A backend failed."""


class BackendUnavailable(BackendError):
    """The backend's library or driver cannot be used on this machine."""


class GpuReadError(BackendError):
    """One GPU failed a read.

    Args:
        kind: ``gpu_lost``, ``reset_required`` or ``unknown`` (the trace format's error kinds).
        detail: the vendor's message.
    """

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


class StoreError(GpuwatchError):
    """The SQLite state store failed."""


class DaemonError(GpuwatchError):
    """The running daemon could not be reached or refused a request."""


class JobError(GpuwatchError):
    """Base of what gpuwatch raises in a training job: in place, snapshots, checkpoints, the report socket."""


class InPlaceError(JobError):
    """Recovery in place could not go on (the job's store, its secret, a group's proof, the state transfer)."""


class SnapshotError(JobError):
    """A host snapshot could not be kept or read."""


class CheckpointError(JobError):
    """No checkpoint could be written or none verifies."""


class DrillError(GpuwatchError):
    """A drill was refused by a guard or could not run."""


class ServiceError(GpuwatchError):
    """`gpuwatch service` could not do its job; the message names the file or command and the fix."""
