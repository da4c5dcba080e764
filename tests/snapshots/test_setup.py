"""Setting the slots up never stalls the training loop: real slots in shared memory, a real CPU training step.

No fakes: the slots are sized, mapped and populated as in a job (here a few hundred MiB, seconds on a
loaded machine), while a Linear stack with AdamW, built on the CPU with its default init, trains on.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpuwatch.snapshots import HostSnapshot

BAR = 4.0  # no step during the set-up slower than this many plain steps


@pytest.fixture
def shm_root(tmp_path: Path) -> Iterator[str]:
    """A directory on the shared-memory file system the slots live on in a job (else the test's own)."""
    if not Path("/dev/shm").is_dir():
        yield str(tmp_path)
        return
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="gpuwatch-test-") as root:
        yield root


def test_no_step_during_the_set_up_is_slower_than_four_plain_steps(shm_root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    frozen = torch.nn.Embedding(1 << 16, 1024)  # 256 MiB the loop reads and never trains (a frozen table)
    frozen.requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)
    ids = torch.randint(0, 1 << 16, (32,))

    def train_step() -> None:
        loss = (model(x) + frozen(ids)[:, :256]).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    def state() -> dict[str, object]:
        return {"model": model.state_dict(), "frozen": frozen.state_dict(), "optim": optim.state_dict()}

    plain = []
    for _ in range(40):
        started = time.perf_counter()
        train_step()
        plain.append(time.perf_counter() - started)
    snap = HostSnapshot(state, every=4, optimizer=optim, job_id="setup", root=shm_root)
    during: list[float] = []
    step, deadline = 0, time.monotonic() + 120
    try:
        while snap.ready_step is None and snap.enabled and time.monotonic() < deadline:
            started = time.perf_counter()
            train_step()
            step += 1
            snap.step(step)
            during.append(time.perf_counter() - started)
        stats = snap.stats()
    finally:
        snap.close(remove=True)
    assert stats["enabled"] and stats["ready_step"] == step, stats
    bar = BAR * statistics.quantiles(plain[5:], n=10)[-1]  # the slow end of the plain steps
    slowest = max(during)
    assert slowest < bar, (
        f"a step during the set-up took {slowest * 1e3:.0f} ms, {slowest / statistics.median(plain):.1f}x a plain "
        f"step ({statistics.median(plain) * 1e3:.1f} ms); set-up {stats['setup_s']:.2f} s over {len(during)} steps"
    )
    assert len(during) >= 5, f"the set-up took {len(during)} steps: too few to judge it"
