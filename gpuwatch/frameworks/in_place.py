"""A framework that owns its process group cannot recover in place: refuse `gpuwatch launch --in-place` at once.

Under `--in-place` each worker starts as a job of one until it joins the membership (`InPlaceJob`).
HF's Trainer and Lightning build their own process group from the environment instead, so each
worker would train alone on the same checkpoints. The callbacks call `refuse_in_place` first, and
the launcher, seeing every worker end before any joined, stops the job (exit 2).
"""

from __future__ import annotations

import os
import sys

from gpuwatch.inplace.protocol import MEMBER_ENV

EXIT_USAGE = 2


def refuse_in_place(framework: str) -> None:
    """Exit 2 with one line when this process is an in-place worker (gpuwatch launch --in-place).

    Raises:
        SystemExit: 2, under --in-place.
    """
    if MEMBER_ENV in os.environ:
        print(
            f"gpuwatch: {framework} owns its process group and cannot recover in place: run it with "
            "`gpuwatch launch` without --in-place (docs/frameworks.md)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_USAGE)
