"""A stand-in for gpuwatch.validation.gpu_test on machines without a GPU: prints the figures it is told to.

`fake_gpu_test.py --tflops 612 --bandwidth 4010 --errors 0 [--exit N] --json`; it also writes the
CUDA_VISIBLE_DEVICES it was given to $FAKE_GPU_TEST_SEEN (when set), so tests can check the target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tflops", type=float, default=612.0)
    parser.add_argument("--bandwidth", type=float, default=4010.0)
    parser.add_argument("--errors", type=int, default=0)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    seen = os.environ.get("FAKE_GPU_TEST_SEEN")
    if seen:
        with open(seen, "w", encoding="utf-8") as out:
            out.write(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if args.exit:
        print("CUDA error: an illegal memory access was encountered", file=sys.stderr)
        return args.exit
    figures = {"matmul_tflops": args.tflops, "mem_bandwidth_gbps": args.bandwidth, "pattern_errors": args.errors}
    print(json.dumps({"device": "NVIDIA H200", **figures, "pattern_bytes": 1 << 30}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
