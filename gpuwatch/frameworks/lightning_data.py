"""A Lightning resume mid-epoch goes on with the batch after the last one trained, not the epoch's first.

Lightning restores its loops' counters from a checkpoint, but a DataLoader without `state_dict` /
`load_state_dict` starts its epoch again from the first batch ("You're resuming from a checkpoint that
ended before the epoch ended and your dataloader is not resumable"): a job resumed at step 83 trained
on batches 0, 1, ... again, and its loss left an uninterrupted run's. gpuwatch's stop and rescue
save mid-epoch by nature, so at the resume (`on_train_start`, after Lightning built the loader's
iterator and before it takes a batch) the iterator is moved past the batches the epoch already
trained, with the sampler set to the epoch first, as Lightning's own resumable loaders would be.
The skipped batches are loaded, not trained (the data loader's time for them, once per resume).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.types import _Stateful

log = logging.getLogger("gpuwatch.frameworks")


def skip_trained_batches(trainer: pl.Trainer) -> int:
    """Move the train loader's iterator past the batches this epoch already trained; how many (0: none to skip).

    Nothing is skipped for loaders Lightning resumes itself (stateful ones), or whose length it does
    not know (its fetcher has taken a batch ahead already).
    """
    loop = trainer.fit_loop
    fetcher: Any = getattr(loop, "_data_fetcher", None)
    combined: Any = getattr(loop, "_combined_loader", None)
    done: int = getattr(loop.epoch_loop.batch_progress.current, "processed", 0)  # a _ProcessedTracker
    if fetcher is None or combined is None or getattr(fetcher, "iterator", None) is None or done <= 0:
        return 0
    loaders = list(combined.flattened)
    if all(isinstance(loader, _Stateful) for loader in loaders):
        return 0  # Lightning restored their position itself
    if fetcher.length is None or done >= fetcher.length or getattr(fetcher, "batches", None):
        log.warning("gpuwatch: the train loader starts its epoch again: its length is unknown")
        return 0
    for loader in loaders:
        _set_sampler_epoch(loader, getattr(loop.epoch_progress.current, "processed", 0))
    for _ in range(done):
        next(fetcher.iterator)
    log.warning("gpuwatch: resumed mid-epoch: skipped the %d batches this epoch already trained", done)
    return done
