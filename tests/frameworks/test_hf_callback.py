"""GpuwatchCallback's own decisions: when HF saves or evaluates, a declared pause; a stop agreed at HF's
last step lets the job finish there; earlier, HF saves that step and the rank exits 75.

One process. A relaunch after a stop at the last step would resume from the final checkpoint, and HF
resumed at `max_steps` trains one step past it: the job's log would end at max_steps + 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments  # noqa: E402

from gpuwatch.frameworks.hf import GpuwatchCallback  # noqa: E402
from gpuwatch.trainer.contract import EXIT_RESUME  # noqa: E402
from gpuwatch.trainer.link import TrainerLink  # noqa: E402
from gpuwatch.trainer.sealed import why_unverified  # noqa: E402
from tests.frameworks.hf_train import RandomTokens  # noqa: E402
from tests.frameworks.tiny import tiny_gpt2  # noqa: E402

STEPS = 6


class StopAt(TrainerCallback):  # type: ignore[misc]
    """The daemon's stop, as it reaches the rank after step `step` (listed before gpuwatch's callback)."""

    def __init__(self, link: TrainerLink, step: int) -> None:
        self.link, self.step = link, step

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            self.link.request_stop("test")


def _train(out: Path, link: TrainerLink, stop_at: int) -> None:
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=100,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    model = tiny_gpt2()
    data = RandomTokens(64, 32, model.config.vocab_size)
    callbacks = [StopAt(link, stop_at), GpuwatchCallback(link)]
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()


@pytest.mark.parametrize(
    ("hook", "flag", "pause"),
    [
        ("on_step_end", "should_save", "checkpoint"),
        ("on_step_end", "should_evaluate", "evaluation"),
        ("on_epoch_end", "should_save", "checkpoint"),  # save_strategy="epoch"
        ("on_step_end", None, None),
    ],
)
def test_hfs_save_or_evaluation_is_a_pause_until_the_next_step(
    tmp_path: Path, link: TrainerLink, hook: str, flag: str | None, pause: str | None
) -> None:
    callback = GpuwatchCallback(link)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, report_to=[], use_cpu=True)
    state, control = TrainerState(max_steps=10, global_step=3), TrainerControl()
    if flag is not None:
        setattr(control, flag, True)  # as HF's DefaultFlowCallback (listed first) set it for this step
    callback.on_step_begin(args, state, control)
    getattr(callback, hook)(args, state, control)
    assert link.report()["pause"] == pause
    callback.on_step_begin(args, state, TrainerControl())
    assert link.report()["pause"] is None


@pytest.mark.slow  # a real HF Trainer: about 10 s on a loaded 2-core machine
def test_a_stop_at_the_last_step_lets_the_job_finish_there(tmp_path: Path, link: TrainerLink) -> None:
    _train(tmp_path / "out", link, stop_at=STEPS)  # returns: no exit 75, so no relaunch

    assert link.last_step == STEPS
    assert [p.name for p in (tmp_path / "out").glob("checkpoint-*")] == [f"checkpoint-{STEPS}"]  # HF's final save
    assert why_unverified(tmp_path / "out" / f"checkpoint-{STEPS}") is None  # sealed


@pytest.mark.slow
def test_a_stop_before_the_last_step_saves_that_step_and_exits_75(tmp_path: Path, link: TrainerLink) -> None:
    with pytest.raises(SystemExit) as leaving:
        _train(tmp_path / "out", link, stop_at=STEPS - 2)

    assert leaving.value.code == EXIT_RESUME and link.last_step == STEPS - 2
    assert why_unverified(tmp_path / "out" / f"checkpoint-{STEPS - 2}") is None
