"""The optimizers that update the snapshotted state in place: their update waits for a copy in flight.

A copy of a tensor the optimizers own must end before their next update changes it; the other
tensors (buffers, step counters) are planned into the flat file as copies. Locking: none; the hooks
are registered, run (inside `optimizer.step`) and removed on the training thread.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

from gpuwatch.snapshots.restore import localize
from gpuwatch.trainer import tensorfile


class Updates:
    """The optimizer(s) given to HostSnapshot (None, one, or several), with `before_update` as their step pre-hook."""

    def __init__(self, optimizer: Any, before_update: Callable[..., None]) -> None:
        self.optimizers = _as_list(optimizer)
        self._hooks = [opt.register_step_pre_hook(before_update) for opt in self.optimizers]

    def owned(self, flat: tensorfile.FlatState) -> list[bool]:
        """For each source: is it a tensor the optimizers update (copied directly, their update waits)?"""
        if not self.optimizers:
            return [True] * len(flat.sources)
        torch = sys.modules["torch"]
        owned: set[tuple[str, int]] = set()
        for opt in self.optimizers:
            tensors = [p for group in opt.param_groups for p in group["params"]]
            tensors += [v for per_param in opt.state.values() for v in per_param.values()]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    local = localize(tensor)
                    owned.add((str(local.device), local.untyped_storage().data_ptr()))
        return [(str(s.device), s.untyped_storage().data_ptr()) in owned for s in flat.sources]

    def remove_hooks(self) -> None:
        """Stop being called before each update (idempotent)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _as_list(optimizer: Any) -> list[Any]:
    if optimizer is None:
        return []
    if isinstance(optimizer, Iterable) and not hasattr(optimizer, "param_groups"):
        return list(optimizer)
    return [optimizer]
