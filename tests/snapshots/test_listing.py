"""A job directory's descriptor is listed by more than one thread of a rank (the restore, the read ahead,
the slots' removal): each listing must see every name, and leave no descriptor behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from gpuwatch.snapshots.layout import names_in

NAMES = 3000
THREADS, LISTINGS = 4, 30


def test_listings_of_one_directory_descriptor_at_once_each_see_every_name(tmp_path: Path) -> None:
    for i in range(NAMES):
        (tmp_path / f"rank-{i:05d}.slot0").touch()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    open_before = len(os.listdir("/proc/self/fd"))
    counts: list[int] = []

    def list_often() -> None:
        for _ in range(LISTINGS):
            counts.append(len(names_in(fd)))

    try:
        threads = [threading.Thread(target=list_often) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        open_after = len(os.listdir("/proc/self/fd"))
    finally:
        os.close(fd)
    assert counts == [NAMES] * (THREADS * LISTINGS)
    assert open_after == open_before
