"""What a Hugging Face ``Trainer`` run guarded by ``SafeTrainingCallback`` shows its user (issue #25):
the Trainer's logs (LR in force, the loss of applied steps, the guard's counts, in time for the
reporters), the abort on the user's own instance after ``restore_callback_states_from_checkpoint``,
and the callback's files beside the Trainer's in ``output_dir``.
"""

from __future__ import annotations

import json
import math
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback  # noqa: E402

from safetrain import TrainingAborted  # noqa: E402
from safetrain.integrations.huggingface import SafeTrainingCallback  # noqa: E402
from safetrain.testing import OutputFault  # noqa: E402
from tests.helpers.huggingface import QUIET, Tokens, args, gpt2, train  # noqa: E402


class Reporter(TrainerCallback):
    """Stands for a reporting integration (W&B, TensorBoard: ``transformers.integrations``), which
    the Trainer runs before the user's callbacks: what it receives is what a dashboard shows."""

    __module__ = "transformers.integrations.stand_in"

    def __init__(self) -> None:
        self.logs: List[Dict[str, Any]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and ("loss" in logs or "grad_norm" in logs):
            self.logs.append({**logs, "step": state.global_step})


def _with_reporter(trainer: Trainer) -> Reporter:
    reporter = Reporter()
    trainer.callback_handler.callbacks.insert(1, reporter)  # where report_to puts it: before the user's
    return reporter


def test_a_skipped_step_is_not_logged_as_loss_0_and_the_reporters_get_the_guards_counts(tmp_path):
    """Before: the reporter saw ``loss 0.0`` at the skipped step (the Trainer's NaN filter copies
    the running sum, 0 in a one-step window) and none of the guard's figures."""
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[4, 5, 6])  # step 4's forward, its re-run and replay
    cb = SafeTrainingCallback(QUIET)
    trainer = Trainer(model=model, args=args(tmp_path, 6, logging_steps=1), train_dataset=Tokens(), callbacks=[cb])
    reporter = _with_reporter(trainer)
    trainer.train()
    at = {h["step"]: h for h in reporter.logs}
    assert sorted(at) == [1, 2, 3, 4, 5, 6], reporter.logs
    assert "loss" not in at[4], "no step of the window was applied: no training loss to show"
    assert all(math.isfinite(at[s]["loss"]) and at[s]["loss"] > 1 for s in (1, 2, 3, 5, 6)), reporter.logs
    assert [at[s]["safetrain/skipped_batches"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 1]
    assert at[6]["safetrain/restores"] == 0 and at[6]["safetrain/lr_backoffs"] == 0
    history = {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}
    assert "loss" not in history[4] and history[5]["safetrain/skipped_batches"] == 1


def test_a_window_with_a_skipped_step_logs_the_mean_of_the_applied_steps(tmp_path):
    """Step 5 is skipped: the window 4-5 (logged at 5, a step the guard acted on) shows step 4's loss."""
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[5, 6, 7])  # step 5's forward, its re-run and replay
    seen: Dict[int, float] = {}

    class Losses(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen[state.global_step] = cb.last.loss

    cb = SafeTrainingCallback(QUIET)
    trainer = Trainer(
        model=model, args=args(tmp_path, 6, logging_steps=3), train_dataset=Tokens(), callbacks=[cb, Losses()]
    )
    reporter = _with_reporter(trainer)
    trainer.train()
    at = {h["step"]: h for h in reporter.logs}
    assert sorted(at) == [3, 5, 6], "every logging step, and the step the guard acted on"
    assert at[5]["loss"] == pytest.approx(seen[4], rel=1e-6), (at[5], seen)
    assert at[6]["loss"] == pytest.approx(seen[6], rel=1e-6), (at[6], seen)
    assert at[3]["loss"] == pytest.approx(sum(seen[s] for s in (1, 2, 3)) / 3, rel=1e-5), "unchanged: no skip"


def test_the_logged_learning_rate_is_the_one_in_force_under_a_backoff(tmp_path):
    """Before: ``learning_rate`` was the schedule's while the optimizer used half of it."""
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[4, 5, 6])
    used: Dict[int, float] = {}

    class Used(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            used[state.global_step + 1] = optimizer.param_groups[0]["lr"]

    cb = SafeTrainingCallback({**QUIET, "recovery": {"actions": {"forward": "scale_lr"}}})
    trainer = Trainer(
        model=model, args=args(tmp_path, 8, logging_steps=1), train_dataset=Tokens(), callbacks=[cb, Used()]
    )
    reporter = _with_reporter(trainer)
    trainer.train()
    at = {h["step"]: h for h in reporter.logs}
    assert at[8]["safetrain/lr_backoffs"] == 1 and at[8]["safetrain/lr_scale"] == 0.5, at[8]
    for step in range(1, 9):
        assert at[step]["learning_rate"] == pytest.approx(used[step]), (step, at[step], used[step])
    schedule = trainer.lr_scheduler.get_last_lr()[0]
    assert used[8] < schedule, "the backoff is in force: the schedule's LR is not what was used"


@pytest.mark.parametrize("on_abort", ["raise", "stop"])
def test_the_users_instance_raises_the_abort_after_restore_callback_states_from_checkpoint(tmp_path, on_abort):
    """``restore_callback_states_from_checkpoint=True`` makes the Trainer build a new callback from
    the checkpoint and drop the user's; before, ``cb.raise_if_aborted()`` on the user's instance
    never raised and its ``result`` stayed ``None``. The instance the Trainer made keeps the
    user's ``on_abort``."""
    train(gpt2(), tmp_path, 4, save_strategy="steps", save_steps=4)
    model = gpt2()
    OutputFault(model.transformer.h[0].attn.c_proj, calls=range(1, 10**9))
    cb = SafeTrainingCallback(QUIET, on_abort=on_abort)
    kw = dict(restore_callback_states_from_checkpoint=True)
    trainer = Trainer(model=model, args=args(tmp_path, 30, **kw), train_dataset=Tokens(), callbacks=[cb])
    if on_abort == "raise":
        with pytest.raises(TrainingAborted) as raised:
            trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
        assert raised.value is cb.aborted
    else:
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    (survivor,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, SafeTrainingCallback)]
    assert survivor is not cb, "the Trainer replaced the user's instance"
    assert survivor.on_abort == on_abort
    with pytest.raises(TrainingAborted):
        cb.raise_if_aborted()
    assert cb.aborted is survivor.aborted and cb.result.ended == "aborted" and trainer.state.global_step < 30


def test_the_callbacks_files_never_share_a_name_with_the_trainers(tmp_path):
    """The journal and metrics live in ``output_dir`` beside the Trainer's checkpoints: each file
    has one writer, and both parse."""
    cb, _, trainer = train(gpt2(), tmp_path, 6, save_strategy="steps", save_steps=3, logging_steps=2)
    assert cb.result.ended == "done"
    top = {p.name for p in tmp_path.iterdir()}
    mine = {"events.jsonl", "metrics.csv"}
    assert mine <= top and top - mine <= {"checkpoint-3", "checkpoint-6", ".safetrain.lock"}, top
    for ckpt in ("checkpoint-3", "checkpoint-6"):
        names = {p.name for p in (tmp_path / ckpt).iterdir()}
        assert not names & mine, names
        state = json.loads((tmp_path / ckpt / "trainer_state.json").read_text())
        assert "SafeTrainingCallback" in state["stateful_callbacks"]
    rows = (tmp_path / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and len(rows) == 7, rows[:2]
    assert all(json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines())
    assert torch.isfinite(torch.tensor(trainer.state.log_history[-1]["train_loss"]))
