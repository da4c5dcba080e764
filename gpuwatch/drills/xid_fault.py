#!/usr/bin/env python3
"""Raise a real XID 31 on one GPU: a sacrificial CUDA process writes to an address nothing maps.

    python3 fault_injection/xid_fault.py --gpu 0          # dry run: print the plan (from a checkout)
    python3 -m gpuwatch.drills.xid_fault --gpu 0 --yes    # do it (any install)

This file ships inside the package, so an installed wheel has it: `gpuwatch drill --xid-fault` runs it
by its path. It imports only the standard library (and pynvml, cupy or torch when it runs), so it also
runs as a plain script.

What happens: a child process, pinned to the GPU through CUDA_VISIBLE_DEVICES=<its UUID>, launches a
one-thread kernel that stores to an unmapped address. The GPU's MMU faults, the driver logs `NVRM: Xid
(PCI:...): 31, pid=..., name=python3, ...`, NVML's event set delivers XID 31, and the driver tears down
that process's CUDA context, so the child fails its synchronize and exits. XID 31 is an application
fault (NVIDIA's XID catalog: RESTART_APP, NONFATAL; docs/hardware-facts.md): no setting of the card
changes, no other process's memory is touched and no reset follows, so it is harmless to the card. That
makes it the one real XID a drill can raise on a healthy GPU.

How the store is made, and why the address faults: gpuwatch/trainer/xid.py (the same store the
fault-rank drill makes inside a training rank through TrainerLink(allow_drills=True)).

Guards (docs/drills.md, Safety): nothing runs without --yes; a GPU that has any process on it is refused
(NVML is asked, so a GPU it cannot see is refused too).

Output: one JSON line on stdout, {"gpu", "pid", "started_t", "exited_t", "returncode"}, times in
Unix seconds. The child's own output goes to stderr. Exit status: 0 when the child died of the fault
(its return code is 3), 1 when it did not, 2 when refused or misused.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from gpuwatch.trainer.xid import DEFAULT_ADDRESS, cupy_store, torch_store

CHILD_FAULTED = 3
CHILD_NOT_FAULTED = 0
CHILD_SETUP_FAILED = 2


class Refused(Exception):
    """A guard refused the run; the message says which and why."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run the plan, the injection, or (internally) the child.

    Args:
        argv: the arguments after the program name (default: sys.argv[1:]).
    """
    args = _parser().parse_args(argv)
    if args.child:
        return _child(args.via, args.address)
    via = _pick_via(args.via)
    try:
        if via is None:
            raise Refused("neither cupy nor torch is importable; one of them (cupy preferred) is required")
        uuid = _check_gpu(args.gpu)
    except Refused as exc:
        print(f"xid_fault: refused: {exc}", file=sys.stderr)
        return 2
    if not args.yes:
        print(f"plan: raise XID 31 on GPU {args.gpu} ({uuid}), which has no processes")
        print(f"  start a child with CUDA_VISIBLE_DEVICES={uuid} that writes to {args.address:#x} through {via}")
        print("  the driver kills the child's CUDA context; its exit is reported as one JSON line")
        print("dry run: nothing was done; add --yes to do it")
        return 0
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    command = [sys.executable, os.path.abspath(__file__), "--child", "--gpu", str(args.gpu), "--via", via]
    command += ["--address", hex(args.address)]
    started_t = time.time()
    child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    try:
        returncode = child.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        returncode = child.wait()
    exited_t = time.time()
    report = {"gpu": args.gpu, "pid": child.pid, "started_t": started_t, "exited_t": exited_t, "returncode": returncode}
    print(json.dumps(report), flush=True)
    return 0 if returncode == CHILD_FAULTED else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Raise a real, harmless XID 31 on one GPU (dry run unless --yes).")
    parser.add_argument("--gpu", type=int, required=True, help="NVML index of the GPU")
    parser.add_argument("--yes", action="store_true", help="really do it (default: print the plan)")
    parser.add_argument("--via", choices=("auto", "cupy", "torch"), default="auto", help="how to launch the store")
    parser.add_argument("--address", type=lambda text: int(text, 0), default=DEFAULT_ADDRESS, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the child")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def _pick_via(via: str) -> str | None:
    """The library that will launch the store, or None when the one asked for is missing."""
    candidates = ("cupy", "torch") if via == "auto" else (via,)
    return next((name for name in candidates if importlib.util.find_spec(name) is not None), None)


def _check_gpu(index: int) -> str:
    """The GPU's UUID, once NVML confirms it exists and has no process on it.

    Raises:
        Refused: NVML is unusable, the GPU does not exist, or something runs on it.
    """
    try:
        import pynvml
    except ImportError as exc:
        raise Refused(f"pynvml is needed to check the GPU for processes: {exc}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise Refused(f"NVML did not initialise ({exc}), so GPU {index} cannot be checked") from None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        procs = [
            *pynvml.nvmlDeviceGetComputeRunningProcesses(handle),
            *pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle),
        ]
    except pynvml.NVMLError as exc:
        raise Refused(f"GPU {index} cannot be read through NVML: {exc}") from None
    finally:
        pynvml.nvmlShutdown()
    if procs:
        raise Refused(f"GPU {index} has processes on it (pids {sorted({p.pid for p in procs})})")
    return uuid.decode() if isinstance(uuid, bytes) else uuid


def _child(via: str, address: int) -> int:
    """The sacrificial process: store to `address` on the only visible GPU and report how it ended."""
    try:
        launch = cupy_store if via == "cupy" else torch_store
        synchronize = launch(address)
    except Exception as exc:  # any failure before the store is a setup failure, not the fault
        print(f"xid_fault child: setup failed: {exc!r}", file=sys.stderr)
        return CHILD_SETUP_FAILED
    try:
        synchronize()
    except Exception as exc:  # the framework's CUDA error: cudaErrorIllegalAddress
        print(f"xid_fault child: the store faulted as intended: {exc}", file=sys.stderr, flush=True)
        # Skip interpreter teardown: the CUDA context is dead and its cleanup would only fail again.
        os._exit(CHILD_FAULTED)
    print(f"xid_fault child: the store to {address:#x} did not fault", file=sys.stderr)
    return CHILD_NOT_FAULTED


if __name__ == "__main__":
    # Run by its path, the package's own folder is sys.path[0]: its siblings (api.py, spec.py, ...)
    # must not shadow top-level modules that cupy or torch import.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    sys.exit(main())
