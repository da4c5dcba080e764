"""What a training rank's error means for its recovery: its own CUDA fault, a failed collective, or neither.

One rule for the whole job side: `TrainerLink` (rescue or not) and the in-place step engine (go on in a
new group, or end) both ask `classify`. The three answers:

* `Fault.CUDA`: this rank's own GPU failed (an XID, an illegal address, ECC, a failed kernel): its state
  may be bad, so it must neither save nor go on;
* `Fault.COLLECTIVE`: a collective failed because a peer did (gloo's closed or reset connection, its
  timeout, an aborted or failed NCCL communicator, torch.distributed's own error types);
* `Fault.OTHER`: anything else, the trainer's own error (a shape mismatch, a network library's
  "connection" error), which no recovery hides.

A CUDA fault wins over a collective one: NCCL's watchdog reports the rank's own illegal access inside its
own message. The markers are the fixed parts of the messages gloo, NCCL, CUDA and cuBLAS/cuDNN raise (the
table test holds real ones, tests/trainer/test_faults.py). stdlib only: torch is looked up when loaded.
"""

from __future__ import annotations

import enum
import sys


class Fault(enum.Enum):
    CUDA = "cuda"
    COLLECTIVE = "collective"
    OTHER = "other"


CUDA_MARKERS = (
    "cuda error",  # torch's C10_CUDA_CHECK: "CUDA error: an illegal memory access was encountered"
    "cuda failure",  # NCCL's own CUDA check: "Cuda failure 'an illegal memory access was encountered'"
    "illegal memory access",
    "illegal instruction",
    "uncorrectable ecc error",
    "unspecified launch failure",
    "cublas_status_",  # "CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( ... )`"
    "cudnn_status_",
    "xid",  # gpuwatch's own drill and the link's fault report name the XID
)
COLLECTIVE_MARKERS = (
    "gloo",  # every gloo error names its source file: "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] ..."
    "nccl",  # "NCCL communicator was aborted", "NCCL error in: ...", "WorkNCCL(SeqNum=...) ran for ..."
    "process group",  # torch's "Process group watchdog thread terminated", the engine's own abort
    "processgroup",
    "connection closed by peer",
    "connection reset by peer",
)


def classify(exc: BaseException) -> Fault:
    """The kind of `exc` (see the module docstring): CUDA first, then collective, else other."""
    torch = sys.modules.get("torch")
    accelerator_error = getattr(torch, "AcceleratorError", None) if torch is not None else None
    text = str(exc).lower()
    if (isinstance(accelerator_error, type) and isinstance(exc, accelerator_error)) or _has(text, CUDA_MARKERS):
        return Fault.CUDA
    dist = getattr(torch, "distributed", None) if torch is not None else None
    dist_error = getattr(dist, "DistError", None)
    if (isinstance(dist_error, type) and isinstance(exc, dist_error)) or _has(text, COLLECTIVE_MARKERS):
        return Fault.COLLECTIVE
    return Fault.OTHER


def first_line(exc: BaseException) -> str:
    """The error's first line (NCCL's and CUDA's go on for a page), or its type when it has no text."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _has(text: str, markers: tuple[str, ...]) -> bool:
    return any(marker in text for marker in markers)
