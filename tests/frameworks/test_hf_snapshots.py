"""`GpuwatchCallback(snapshot_every=K)`: a resume lands on the newest host snapshot when it is newer than the
newest verified `checkpoint-N`, and on that checkpoint when the snapshot is missing or torn.

One process, a real HF Trainer on the CPU: checkpoints every 20 steps, a snapshot every 5, the job
dies after step 27 (the snapshot of step 25 committed); then a new Trainer, as the relaunch builds it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real HF Trainer twice per test: about 30 s each on a loaded 2-core machine

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from gpuwatch.frameworks.hf import GpuwatchCallback  # noqa: E402
from gpuwatch.snapshots.slot import HEADER_LEN  # noqa: E402
from gpuwatch.trainer.link import TrainerLink  # noqa: E402
from tests.frameworks.hf_train import RandomTokens  # noqa: E402
from tests.frameworks.tiny import tiny_gpt2  # noqa: E402


class Died(Exception):
    pass


class DieAfter(TrainerCallback):  # type: ignore[misc]
    """Keeps the model's weights at `keep_at`; the job dies after step `die_after`."""

    def __init__(self, keep_at: int, die_after: int | None) -> None:
        self.keep_at, self.die_after = keep_at, die_after
        self.kept: dict[str, torch.Tensor] = {}
        self.first_step: int | None = None

    def on_step_end(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
        if self.first_step is None:
            self.first_step = state.global_step
        if state.global_step == self.keep_at:
            self.kept = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if state.global_step == self.die_after:
            raise Died(f"after step {state.global_step}")


def _trainer(out: Path, link: TrainerLink, spy: DieAfter, steps: int = 30) -> tuple[Trainer, GpuwatchCallback]:
    torch.manual_seed(0)
    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=20,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    (out.parent / "shm").mkdir(exist_ok=True)  # /dev/shm's stand-in
    callback = GpuwatchCallback(link, snapshot_every=5, snapshot_root=str(out.parent / "shm"))
    data = RandomTokens(512, 32, model.config.vocab_size)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[callback, spy]), callback


def _die_after_step_27(out: Path, link: TrainerLink) -> dict[str, torch.Tensor]:
    spy = DieAfter(keep_at=25, die_after=27)
    trainer, callback = _trainer(out, link, spy)
    with pytest.raises(Died):
        trainer.train(resume_from_checkpoint=get_last_checkpoint(str(out)))
    assert callback.snapshots is not None
    callback.snapshots.close(finished=False)  # what was in flight is committed, as in a process that died later
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-20"]
    return spy.kept


def _resume(out: Path, link: TrainerLink) -> tuple[str, DieAfter]:
    spy = DieAfter(keep_at=-1, die_after=None)
    trainer, _ = _trainer(out, link, spy)  # the relaunch: on_init_end restores before get_last_checkpoint looks
    last = get_last_checkpoint(str(out))
    trainer.train(resume_from_checkpoint=last)
    return Path(last).name, spy


def test_a_snapshot_newer_than_the_newest_verified_checkpoint_is_what_hf_resumes_from(
    tmp_path: Path, link: TrainerLink
) -> None:
    out = tmp_path / "out"
    at_25 = _die_after_step_27(out, link)

    resumed, spy = _resume(out, link)

    assert resumed == "checkpoint-25" and spy.first_step == 26
    restored = load_file(out / "checkpoint-25" / "model.safetensors")
    for name, tensor in restored.items():
        assert torch.equal(tensor, at_25[name]), name
    assert (out / "checkpoint-25" / "optimizer.pt").is_file() and (out / "checkpoint-25" / "manifest.json").is_file()


def test_with_no_snapshot_hf_resumes_from_the_newest_verified_checkpoint(tmp_path: Path, link: TrainerLink) -> None:
    out = tmp_path / "out"
    _die_after_step_27(out, link)
    shutil.rmtree(tmp_path / "shm")  # a reboot, another node
    (tmp_path / "shm").mkdir()

    resumed, spy = _resume(out, link)

    assert resumed == "checkpoint-20" and spy.first_step == 21


def test_a_torn_snapshot_is_passed_over_for_the_newest_verified_checkpoint(
    tmp_path: Path, link: TrainerLink, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    _die_after_step_27(out, link)
    slots = [p for p in (tmp_path / "shm").rglob("*") if p.is_file() and p.stat().st_size > HEADER_LEN]
    newest = max(slots, key=lambda p: p.stat().st_mtime_ns)
    data = bytearray(newest.read_bytes())
    data[HEADER_LEN + 8192 + 3] ^= 0xFF  # one bit of the tensor bytes, after the commit
    newest.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING):
        resumed, spy = _resume(out, link)

    assert resumed == "checkpoint-20" and spy.first_step == 21
    assert f"host snapshot {newest.name} (step 25) not used: crc32 mismatch" in caplog.text
