"""The exception tree: everything gpuwatch gives up with in a training job is caught by one `except JobError`, and
each error keeps the builtin base its callers caught before (a ValueError, a RuntimeError, a ConnectionError)."""

from __future__ import annotations

import pytest

from gpuwatch.errors import CheckpointError, GpuwatchError, InPlaceError, JobError, SnapshotError
from gpuwatch.inplace.engine import NotInPlace
from gpuwatch.inplace.groupproof import GroupProofError
from gpuwatch.inplace.jobstore import StoreAuthError
from gpuwatch.inplace.secret import SecretError
from gpuwatch.inplace.transfer import HeaderError
from gpuwatch.snapshots.layout import SnapshotDirError
from gpuwatch.snapshots.staged import LayoutChanged
from gpuwatch.trainer.channel import ReportsUnreachable
from gpuwatch.trainer.tensorfile import FlatFileError

# each job-side error, the branch it hangs from, and the builtin its callers catch
JOB_ERRORS = [
    (NotInPlace, InPlaceError, RuntimeError),
    (SecretError, InPlaceError, ValueError),
    (StoreAuthError, InPlaceError, ConnectionError),
    (GroupProofError, InPlaceError, RuntimeError),
    (HeaderError, InPlaceError, ValueError),
    (SnapshotDirError, SnapshotError, Exception),
    (LayoutChanged, SnapshotError, Exception),
    (FlatFileError, CheckpointError, Exception),
    (CheckpointError, JobError, Exception),
    (ReportsUnreachable, JobError, RuntimeError),
]


@pytest.mark.parametrize(("error", "branch", "builtin"), JOB_ERRORS, ids=[e[0].__name__ for e in JOB_ERRORS])
def test_a_job_side_error_is_caught_by_except_job_error_its_branch_and_its_builtin(
    error: type[Exception], branch: type[Exception], builtin: type[Exception]
) -> None:
    for catch in (JobError, GpuwatchError, branch, builtin):
        with pytest.raises(catch) as caught:
            raise error("the message")
        assert str(caught.value) == "the message"


def test_the_daemons_errors_are_no_job_errors() -> None:
    from gpuwatch.errors import ConfigError, DaemonError, StoreError

    for error in (ConfigError, DaemonError, StoreError):
        assert not issubclass(error, JobError)
