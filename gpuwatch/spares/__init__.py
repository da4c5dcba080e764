"""Warm spare workers: processes that already started the interpreter and imported torch, waiting to
become a rank that must be replaced.

A replacement's cold start (a new interpreter, `import torch`, the CUDA context) is most of the
seconds between a rank's loss and the job's next step; a spare has paid it in advance. The launcher
keeps N of them per node (`gpuwatch launch --in-place --spares N`); when a rank must be replaced it
hands one the rank's command and environment (`SparePool.hand_over`) and starts another behind it.
By default each spare is a standby: it runs the job's own command at once, up to where the script
joins the job (gpuwatch.trainer.standby), so the job's set-up is paid before the fault too.

* `gpuwatch.spares.worker`: the spare process (`python -m gpuwatch.spares.worker`);
* `gpuwatch.spares.pool`: the launcher's side, `SparePool`, and each rank's last word;
* `gpuwatch.spares.room`: whether a GPU has room for a replacement beside a dying rank's memory (NVML);
* `gpuwatch.bench.recovery_spare`: a spare against a cold start, for `gpuwatch bench --only recovery`.

docs/spares.md is the user guide.
"""

from __future__ import annotations

from gpuwatch.spares.pool import SparePool

__all__ = ["SparePool"]
