"""The sacrificial GPU test: matmul throughput, device-memory bandwidth, a memory pattern write/read-back.

Run as its own process on one GPU (the gate sets CUDA_VISIBLE_DEVICES to the GPU's uuid), so a
fault it provokes kills this process, not the daemon. It only measures and prints one JSON line
(`--json`) or a short table; the gate (gpuwatch.validation) compares the figures with the model's
reference. Needs torch with CUDA; exits 2 without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

_GIB = 1 << 30


def measure(matmul_n: int = 8192, copy_gib: float = 2.0, pattern_gib: float = 16.0) -> dict[str, Any]:
    """The three figures on cuda:0; each test's tensors are freed before the next (its own function)."""
    import torch  # noqa: PLC0415 (only this process needs torch)

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device for torch {torch.__version__} (CUDA_VISIBLE_DEVICES or a CPU-only build)")
    words = int(min(pattern_gib * _GIB, torch.cuda.mem_get_info()[0] * 0.3)) // 4
    return {
        "device": torch.cuda.get_device_name(0),
        "matmul_tflops": round(_matmul_tflops(torch, matmul_n), 1),
        "mem_bandwidth_gbps": round(_copy_gbps(torch, int(copy_gib * _GIB) // 4), 1),
        "pattern_errors": _pattern_errors(torch, words),
        "pattern_bytes": words * 4,
    }


def _timed(torch: Any, fn: Any, iters: int) -> float:
    """Seconds for `iters` calls of `fn` on the GPU, after 3 warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / 1000.0


def _matmul_tflops(torch: Any, n: int, iters: int = 50) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return float(2 * n**3 * iters / _timed(torch, lambda: torch.mm(a, b, out=c), iters) / 1e12)


def _copy_gbps(torch: Any, words: int, iters: int = 20) -> float:
    src = torch.ones(words, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    return float(2 * words * 4 * iters / _timed(torch, lambda: dst.copy_(src), iters) / 1e9)  # read + write


def _pattern_errors(torch: Any, words: int) -> int:
    buf = torch.empty(words, device="cuda", dtype=torch.int32)
    errors = 0
    for pattern in (0, -1, 0x5A5A5A5A, -0x5A5A5A5B):  # all zeros, all ones, 0101…, 1010…
        buf.fill_(pattern)
        errors += int((buf != pattern).sum().item())
    addresses = torch.arange(words, device="cuda", dtype=torch.int32)  # each word its own address
    buf.copy_(addresses)
    return errors + int((buf != addresses).sum().item())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m gpuwatch.validation.gpu_test", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    try:
        figures = measure()
    except ImportError as exc:
        print(f"gpu_test: torch is not importable: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a CUDA error is the finding: one line the gate quotes
        print(f"gpu_test: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:20} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
