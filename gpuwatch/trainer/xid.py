"""A real, harmless XID 31 in this process's own CUDA context: one store to an address nothing maps.

The GPU's MMU faults, the driver logs `NVRM: Xid (...): 31, pid=...` and tears down the calling
process's CUDA context (every later CUDA call in the process fails); no setting of the card
changes and no other process is touched, so no reset follows. Used in two places:
`fault_injection/xid_fault.py` (a sacrificial child process) and `TrainerLink(allow_drills=True)`
(the fault-rank drill: a training rank loses its own context, as with a real fault).

The default address, 2**48, lies above every user address an x86-64 CPU can map (2**47) and so
above every CUDA allocation (unified addressing shares the CPU's address space), yet inside the
GPU's own virtual address range: the store reaches the MMU and faults there.

How the store is made:
* torch: torch cannot launch a kernel on a raw integer address, but `torch.as_tensor` accepts any
  object with the public `__cuda_array_interface__` and checks only its base pointer. The interface
  describes a real one-element allocation with a byte stride that puts element 1 at the address;
  `fill_()` then writes it.
* CuPy: a RawKernel stores to the address, passed at run time so the compiler cannot see it.
"""

from __future__ import annotations

from collections.abc import Callable

DEFAULT_ADDRESS = 1 << 48

KERNEL = r"""
extern "C" __global__ void gpuwatch_xid31(unsigned long long address) {
    *(volatile unsigned int *)address = 0x31u;
}
"""


def torch_store(address: int = DEFAULT_ADDRESS, device: int | None = None) -> Callable[[], object]:
    """Launch a store to `address` on CUDA `device` (default: the current one); returns the synchronize
    that surfaces the fault as the framework's CUDA error.

    Raises:
        ValueError: the address is not above the scratch allocation by whole elements.
    """
    import torch

    target = torch.device("cuda", device) if device is not None else torch.device("cuda")
    base = torch.zeros(1, dtype=torch.int32, device=target)
    pointer = base.data_ptr()
    if address <= pointer or (address - pointer) % base.element_size():
        raise ValueError(f"address {address:#x} is not above the allocation at {pointer:#x} by whole elements")

    class StridedView:
        """Two int32 elements: the real allocation, and the unmapped address one stride later."""

        __cuda_array_interface__ = {
            "shape": (2,),
            "typestr": "<i4",
            "data": (pointer, False),
            "strides": (address - pointer,),
            "version": 3,
        }

    view = torch.as_tensor(StridedView(), device=base.device)
    view.fill_(0x31)
    return lambda: torch.cuda.synchronize(base.device)


def cupy_store(address: int = DEFAULT_ADDRESS, device: int | None = None) -> Callable[[], object]:
    """Launch the store kernel with CuPy on `device` (default: the current one); returns the synchronize."""
    import cupy

    with cupy.cuda.Device(device if device is not None else cupy.cuda.runtime.getDevice()):
        kernel = cupy.RawKernel(KERNEL, "gpuwatch_xid31")
        kernel((1,), (1,), (cupy.uint64(address),))
    return cupy.cuda.runtime.deviceSynchronize
