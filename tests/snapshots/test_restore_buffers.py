"""The restore's pinned host buffers: lent to one read at a time, kept for the process's next restore.

Pinning needs CUDA, so a stand-in makes the buffers here; test_gpu.py reads through real ones.
"""

from __future__ import annotations

import pytest

from gpuwatch.snapshots import restore


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every buffer pinned anew, in order (none kept from before)."""
    pinned: list[object] = []
    monkeypatch.setattr(restore, "_pinned", [])
    monkeypatch.setattr(restore, "_pin_piece", lambda: pinned.append(object()) or pinned[-1])
    return pinned


def test_two_reads_at_once_never_fill_the_same_buffer(made: list[object]) -> None:
    with restore.pinned_buffers(4) as first, restore.pinned_buffers(4) as second:
        assert not {id(b) for b in first} & {id(b) for b in second}
    assert len(made) == 8


def test_the_next_read_takes_the_kept_buffers_and_pins_none(made: list[object]) -> None:
    assert restore.pin_restore_buffers() == 2 * restore.RESTORE_WORKERS * restore.PIECE
    with restore.pinned_buffers(2 * restore.RESTORE_WORKERS) as lent:
        assert lent == made
    assert len(made) == 2 * restore.RESTORE_WORKERS


def test_a_read_that_fails_gives_its_buffers_back(made: list[object]) -> None:
    with pytest.raises(OSError), restore.pinned_buffers(3):
        raise OSError("a slot that could not be read")
    with restore.pinned_buffers(3) as lent:
        assert lent == made
    assert len(made) == 3
