"""A Hugging Face Trainer job as a user writes it, with gpuwatch's one line (and HF's own resume).

A tiny GPT-2 built from its config on the CPU (gloo under torchrun), random tokens. Besides the
documented line it has only the test's instruments: `StepLog` writes each finished step to the job's
own log (`--log`, one file per rank: "step PID N" at the step's end, "loss PID N LOSS" once HF
logged it), and slows the steps (`--step-sleep`) so a test can strike at a step.

    gpuwatch launch -- tests/frameworks/hf_train.py --out DIR --log LOG [--steps N] [--save-steps N]
        [--cuda [--fsdp]]
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from gpuwatch.frameworks.hf import GpuwatchCallback
from tests.frameworks.tiny import job_options, tiny_gpt2

FSDP2: dict[str, Any] = {
    "fsdp": "full_shard",
    "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
}


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class StepLog(TrainerCallback):  # type: ignore[misc]
    """The job's own step log, flushed line by line; and a sleep per step."""

    def __init__(self, path: str, sleep_s: float, save_sleep_s: float) -> None:
        self.file = open(f"{path}.rank{os.environ.get('RANK', '0')}", "a")  # noqa: SIM115
        self.sleep_s, self.save_sleep_s = sleep_s, save_sleep_s

    def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if os.environ.get("RANK", "0") == "0":  # a slow save on rank 0: the other ranks wait for it
            time.sleep(self.save_sleep_s)

    def on_log(self, args, state, control, logs=None, **kw):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            self.file.write(f"loss {os.getpid()} {state.global_step} {logs['loss']}\n")
            self.file.flush()

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        self.file.write(f"step {os.getpid()} {state.global_step}\n")  # before gpuwatch's callback (listed first)
        self.file.flush()
        time.sleep(self.sleep_s)


def main() -> None:
    options = job_options()
    torch.manual_seed(0)
    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=options.out,
        max_steps=options.steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=options.save_steps,
        save_total_limit=3,
        logging_steps=1,
        report_to=[],
        use_cpu=not options.cuda,
        ddp_backend="nccl" if options.cuda else "gloo",
        **FSDP2 if options.fsdp else {},  # accelerate applies FSDP only on accelerators: on the CPU it is DDP
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(4096, 32, model.config.vocab_size),
        callbacks=[
            StepLog(options.log, options.step_sleep, options.save_sleep),
            GpuwatchCallback(),
        ],  # the one line: GpuwatchCallback()
    )
    trainer.train(resume_from_checkpoint=get_last_checkpoint(args.output_dir))


if __name__ == "__main__":
    main()
