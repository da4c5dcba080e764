#!/usr/bin/env python3
"""Can a survivor re-enter a Hugging Face Trainer's `train()` in its own process after a peer's death?

    python tests/hardware/hf_reentry_probe.py            # 2 gloo ranks on the CPU, its own rendezvous

Not under `gpuwatch launch` (torchrun ends every worker when one dies): two processes of a tiny
GPT-2 under HF's Trainer with a rendezvous of their own (MASTER_ADDR/PORT). Rank 1 is SIGKILLed
after step 20. Rank 0's `train()` raises gloo's "Connection closed by peer"; it saves the step it
holds in HF's layout (gpuwatch.frameworks.hf_snapshot.write_hf_checkpoint), starts a replacement
rank 1, destroys its process group, resets accelerate's process-wide state
(`AcceleratorState._reset_state(reset_partial_state=True)`), builds a new Trainer on a new port and
calls `train(resume_from_checkpoint=...)` again. It prints one JSON object: the step the fault
struck after, the step the re-entry resumed from, the seconds from the fault to the first resumed
step and the replacement's import time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PORT = 29650
KILL_AFTER = 20
STEPS = 40


def _rendezvous(rank: int, generation: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(PORT + generation),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )


def worker(rank: int, generation: int, out: str) -> None:
    """One rank: train; the survivor of the kill re-enters `train()` with a replacement."""
    started = time.time()
    _rendezvous(rank, generation)
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from gpuwatch.frameworks.hf_snapshot import trainer_state_json, write_hf_checkpoint
    from tests.frameworks.hf_train import RandomTokens
    from tests.frameworks.tiny import tiny_gpt2

    imported_s = time.time() - started
    first_steps: list[tuple[int, float]] = []

    class Steps(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            first_steps.append((state.global_step, time.time()))
            time.sleep(0.05)
            if rank == 1 and generation == 0 and state.global_step == KILL_AFTER:
                os.kill(os.getpid(), signal.SIGKILL)

    def trainer() -> Trainer:
        torch.manual_seed(0)
        model = tiny_gpt2()
        args = TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, save_strategy="no", report_to=[],
            use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=0,
        )  # fmt: skip
        return Trainer(model=model, args=args, train_dataset=RandomTokens(512, 32, 128), callbacks=[Steps()])

    job = trainer()
    try:
        job.train(resume_from_checkpoint=get_last_checkpoint(out) if generation else None)
        if generation:
            print(json.dumps({"replacement_import_s": round(imported_s, 1)}), flush=True)
        return
    except RuntimeError as exc:
        fault_t, held = time.time(), job.state.global_step
        print(f"rank {rank}: {str(exc)[:120]}", file=sys.stderr, flush=True)
    state = {
        "model": job.model.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.lr_scheduler.state_dict(),
    }
    write_hf_checkpoint(Path(out), held, job.model, state, trainer_state_json(job.state))
    replacement = subprocess.Popen([sys.executable, __file__, "--worker", "1", "1", out])
    dist.destroy_process_group()
    AcceleratorState._reset_state(reset_partial_state=True)
    _rendezvous(rank, 1)
    first_steps.clear()
    job = trainer()
    job.train(resume_from_checkpoint=get_last_checkpoint(out))
    replacement.wait(timeout=120)
    resumed_step, resumed_t = first_steps[0]
    result = {
        "fault_after_step": held,
        "resumed_from": resumed_step - 1,
        "steps_lost": held - (resumed_step - 1),
        "fault_to_first_resumed_step_s": round(resumed_t - fault_t, 1),
        "finished_at": job.state.global_step,
    }
    print(json.dumps(result), flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return 0
    out = tempfile.mkdtemp(prefix="gpuwatch-reentry-")
    ranks = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "0", out]) for r in (0, 1)]
    return ranks[0].wait(timeout=300)


if __name__ == "__main__":
    sys.exit(main())
