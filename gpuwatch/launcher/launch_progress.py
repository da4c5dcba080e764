"""The job's progress in one launch (its furthest step, a relaunch's first), from its ranks' step pages.

Locking: none. While the launch runs only the watch's own thread reads the pages and changes its
fields; the launch loop reads them after the `with` block, which joins that thread first.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from gpuwatch.trainer.contract import STEP_PAGE_BYTES, StepPage, read_step_page, step_page_pid


class ProgressWatch:
    """The job's progress in one launch, from its ranks' step pages in the launch's own directory.

    Each launch gets a fresh directory, private to our user (GPUWATCH_LAUNCH_DIR): every rank of
    it rewrites its `<pid>.step` at each step, and the page stays after the rank is gone, so the
    furthest step is exact even for a rank killed by SIGKILL. A light thread reads the pages every
    POLL_S while the launch runs (to say when it resumed) and once more at the end.
    """

    POLL_S = 0.5

    def __init__(self, launch_dir: Path, on_first_step: Callable[[int], None] | None = None) -> None:
        self.launch_dir = launch_dir
        self.on_first_step = on_first_step
        self.furthest: int | None = None
        self.first_step: int | None = None
        self.reported = False  # a rank opened a step page (a TrainerLink): without one, no step is known
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwatch-launch-progress", daemon=True)

    def __enter__(self) -> ProgressWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self.read()

    def _run(self) -> None:
        while not self._done.wait(self.POLL_S):
            self.read()

    def read(self) -> None:
        """Fold the pages there now into `furthest` and `first_step`."""
        try:
            names = [entry.name for entry in os.scandir(self.launch_dir)]
        except OSError:
            return
        for name in names:
            page = _read_own_page(self.launch_dir / name) if step_page_pid(name) is not None else None
            self.reported = self.reported or page is not None
            if page is None or page.step is None:
                continue
            if self.furthest is None or page.step > self.furthest:
                self.furthest = page.step
            first = page.first_step
            if first is not None and (self.first_step is None or first < self.first_step):
                if self.first_step is None and self.on_first_step is not None:
                    self.on_first_step(first)
                self.first_step = first

    def when(self) -> str:
        """ "after step 37", "before its first step", or what is known when no rank reports steps (no TrainerLink)."""
        if self.furthest is not None:
            return f"after step {self.furthest}"
        return "before its first step" if self.reported else "(no rank reports its steps)"


def _read_own_page(path: Path) -> StepPage | None:
    """A step page our own user wrote (a regular file, not a link), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return read_step_page(os.pread(fd, STEP_PAGE_BYTES, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
