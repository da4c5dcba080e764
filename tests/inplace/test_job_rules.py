"""The two judgements a rank of an in-place job makes alone: whether a stop is its own, and whether
an error is a peer's failure (go on) or its own CUDA fault (end)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from gpuwatch.inplace.job import leaves  # noqa: E402
from gpuwatch.trainer.faults import Fault, classify  # noqa: E402


@pytest.mark.parametrize(
    ("reason", "quarantined", "status_file", "expected"),
    [
        (None, False, True, False),  # nothing asked
        (None, True, True, True),  # status.json quarantines this rank's GPU (seen before any signal)
        ("gpuwatch quarantined GPU-1", False, True, True),  # the link read status.json first
        ("signal SIGUSR1", False, True, False),  # today's daemon signals the whole job for a peer's GPU
        ("signal SIGUSR1", False, False, True),  # no daemon: an operator's stop is for this rank
        ("signal SIGTERM", False, True, True),  # ended from outside
    ],
)
def test_a_rank_leaves_only_for_its_own_gpu(
    reason: str | None, quarantined: bool, status_file: bool, expected: bool
) -> None:
    assert leaves(reason, quarantined=quarantined, status_file=status_file) is expected


@pytest.mark.parametrize(
    ("error", "peer_failure"),
    [
        (RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"), True),
        (RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"), True),
        (RuntimeError("NCCL communicator was aborted on rank 0"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),  # its own XID: end
        (ValueError("mat1 and mat2 shapes cannot be multiplied"), False),  # the trainer's bug: end
    ],
)
def test_a_peers_failure_is_told_from_the_ranks_own_fault(error: Exception, peer_failure: bool) -> None:
    assert (classify(error) is Fault.COLLECTIVE) is peer_failure
