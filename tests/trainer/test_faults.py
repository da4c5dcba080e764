"""The job side's one fault classifier over a table of real error messages (gloo, NCCL, CUDA, cuBLAS/cuDNN, and
the trainer's own errors), the rule both the TrainerLink's rescue and the in-place step engine follow."""

from __future__ import annotations

import pytest

from gpuwatch.trainer.faults import Fault, classify, first_line

CUDA, COLLECTIVE, OTHER = Fault.CUDA, Fault.COLLECTIVE, Fault.OTHER

TABLE = [
    # gloo: a peer's process is gone, or hangs past the group's timeout
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:18263", COLLECTIVE),
    (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:40208: Connection reset by peer",
        COLLECTIVE,
    ),  # fmt: skip
    (
        "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv "
        "operation to complete",
        COLLECTIVE,
    ),  # fmt: skip
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:446] Write error [127.0.0.1]:52340: Broken pipe", COLLECTIVE),
    ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:105] Application timeout caused pair closure", COLLECTIVE),
    ("Connection reset by peer", COLLECTIVE),  # a store's or a transport's bare message
    # NCCL: the watcher aborted the communicator, a peer died, the watchdog timed out
    ("NCCL communicator was aborted on rank 0.", COLLECTIVE),
    (
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or "
        "there was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a "
        "network error or a remote process exiting prematurely.",
        COLLECTIVE,
    ),  # fmt: skip
    (
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=30000) ran for 30012 milliseconds before timing out.",
        COLLECTIVE,
    ),  # fmt: skip
    ("the process group was aborted during the step (generation 3)", COLLECTIVE),  # the step engine's own
    # CUDA: this rank's own GPU (its state may be bad), also inside an NCCL watchdog's message
    (
        "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously reported at "
        "some other API call, so the stacktrace below might be incorrect.",
        CUDA,
    ),  # fmt: skip
    ("CUDA error: uncorrectable ECC error encountered", CUDA),
    ("CUDA error: unspecified launch failure", CUDA),
    ("CUDA error: an illegal instruction was encountered", CUDA),
    (
        "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k, &alpha, a, lda, b, ldb, "
        "&beta, c, ldc)`",
        CUDA,
    ),  # fmt: skip
    ("cuDNN error: CUDNN_STATUS_EXECUTION_FAILED", CUDA),
    (
        "[PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: CUDA error: "
        "an illegal memory access was encountered",
        CUDA,
    ),  # fmt: skip
    ("NCCL WARN Cuda failure 'an illegal memory access was encountered'", CUDA),
    ("gpuwatch drill: XID 31 raised in this rank's own context", CUDA),
    # the trainer's own errors: no recovery hides them (the old word lists took the first two for a peer's)
    (
        "HTTPSConnectionPool(host='huggingface.co', port=443): Max retries exceeded with url: /api/models "
        "(Caused by NewConnectionError: Failed to establish a new connection)",
        OTHER,
    ),  # fmt: skip
    ("The read operation timed out", OTHER),
    ("mat1 and mat2 shapes cannot be multiplied (8x32 and 16x1)", OTHER),
    ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB", OTHER),
    ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!", OTHER),
]


@pytest.mark.parametrize(("message", "fault"), TABLE)
def test_each_real_message_is_classified_by_the_one_rule(message: str, fault: Fault) -> None:
    assert classify(RuntimeError(message)) is fault


def test_torch_distributed_error_types_are_collective_and_accelerator_errors_cuda() -> None:
    torch = pytest.importorskip("torch")
    assert classify(torch.distributed.DistNetworkError("recv failed")) is COLLECTIVE
    assert classify(torch.distributed.DistStoreError("wait timeout")) is COLLECTIVE
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if isinstance(accelerator_error, type):
        assert classify(accelerator_error("an error the text does not name")) is CUDA


def test_the_link_and_the_engine_ask_the_same_classifier() -> None:
    """Neither keeps a word list of its own (they drifted apart before: one rule now)."""
    pytest.importorskip("torch")
    from gpuwatch.inplace import engine
    from gpuwatch.trainer import link

    assert link.classify is classify and engine.classify is classify
    for module in (link, engine):
        assert not [name for name in vars(module) if name.endswith("_WORDS")], module.__name__


def test_first_line_is_the_message_head_or_the_type() -> None:
    assert first_line(RuntimeError("CUDA error: x\nmore")) == "CUDA error: x"
    assert first_line(TimeoutError()) == "TimeoutError"
