"""safetrain inside a real ``transformers.Trainer`` (issue #19): ``SafeTrainingCallback``.

Tiny GPT-2 and BERT models built from configs with random weights (no downloads), synthetic token
data with padding and attention masks, on the CPU. Each fault is injected with
``safetrain.testing`` and must be found at its step and layer, the action carried out by the
Trainer's own loop (a skipped step leaves every parameter as it was although the Trainer calls
``optimizer.step()``), and the run must end with finite parameters.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
)

from safetrain import Guard, TrainingAborted  # noqa: E402
from safetrain.integrations import huggingface as hf  # noqa: E402
from safetrain.integrations.huggingface import SafeTrainingCallback  # noqa: E402
from safetrain.testing import GradFault, OutputFault, WeightFault, count_host_syncs  # noqa: E402
from tests.helpers.huggingface import QUIET, Moves, Tokens, args, gpt2, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(cfg)


def anomalies(cb: SafeTrainingCallback) -> List[Any]:
    return [e for e in cb.result.events if e.name == "anomaly"]


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def journal(out: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]


def ended(out: Path) -> Dict[str, Any]:
    (last,) = [e for e in journal(out) if e.get("event") == "run_ended"]
    return last


def test_a_healthy_run_of_104_steps_with_padding_and_attention_masks_raises_no_alarm(tmp_path):
    """BERT turns the padding's attention mask into large negative scores: no false positive."""
    model = bert()
    data = Tokens(classify=True, length=8)
    cb, moves, trainer = train(model, tmp_path, 104, data=data, per_device_train_batch_size=4, logging_steps=26)
    assert anomalies(cb) == []
    c = cb.result
    assert c.steps == c.healthy_steps == c.optimizer_steps == trainer.state.global_step == 104
    assert all(moves.moved.values()) and finite(model) and cb.aborted is None
    assert cb.result.ended == "done" and ended(tmp_path)["action"] == "done"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all(h["grad_norm"] > 0 and h["safetrain/lr_scale"] == 1.0 for h in logged)


class Embeds(Tokens):
    """The same rows as float ``inputs_embeds`` (what the guard scans); row ``bad`` holds a NaN."""

    def __init__(self, bad: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.table, self.bad = torch.randn(100, 32, generator=torch.Generator().manual_seed(3)), bad

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        row = super().__getitem__(i)
        embeds = self.table[row.pop("input_ids")]
        if i == self.bad:
            embeds[0, 0] = math.nan
        return {"inputs_embeds": embeds, **row}


def test_a_nan_input_row_is_dropped_and_the_step_trains_on_the_rest(tmp_path):
    model = gpt2()
    cb, moves, trainer = train(model, tmp_path, 8, data=Embeds(bad=5))
    (found,) = anomalies(cb)
    assert found.kind == "input" and found.action == "drop_rows" and "inputs_embeds" in found.message
    assert moves.moved[found.step] is True, "the step trains on the other rows (the guard's re-run)"
    assert cb.result.dropped_rows == 1 and cb.result.optimizer_steps == 8 and finite(model)


def test_a_layer_emitting_nan_at_one_step_is_skipped_and_the_parameters_stay(tmp_path):
    model = gpt2()
    # the 7th forward is step 7's; the replay's forwards (calls 8, 9) are spoiled too: not transient
    OutputFault(model.transformer.h[1].mlp, calls=[7, 8, 9])
    cb, moves, trainer = train(model, tmp_path, 12, {"snapshot": {"every": 5}})
    (found,) = anomalies(cb)
    assert found.step == 7 and found.kind == "forward" and "transformer.h.1.mlp" in found.message
    assert found.action == "skip_batch"
    assert moves.moved[7] is False, "a skipped step must leave every parameter although the Trainer stepped"
    assert all(moved for step, moved in moves.moved.items() if step != 7)
    assert cb.result.skipped_batches == 1 and finite(model)
    assert trainer.state.global_step == 12 and cb.result.optimizer_steps == 11


def test_an_inf_gradient_is_zeroed_in_its_parameter_only_before_the_trainer_clips(tmp_path):
    """The guard decides at the end of the backward, before the Trainer's clip (max_grad_norm=1.0):
    clipping with an Inf norm multiplies every gradient by 1/inf = 0 (Inf ones become NaN), so a
    decision after it would step with no gradient at all. Here the Inf one is zeroed and the optimizer
    gets the others, clipped by the Trainer."""
    model = gpt2()
    weight = model.transformer.h[0].attn.c_attn.weight
    GradFault(weight, calls=[5, 6])  # step 5's backward and its replay's: not transient
    seen: Dict[str, Any] = {}

    class Watch(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 4:  # (counted after the step) the gradients optimizer.step() gets at step 5
                seen["bad"] = weight.grad.abs().sum().item()
                seen["rest"] = model.lm_head.weight.grad.norm().item()

    cb, moves, trainer = train(model, tmp_path, 8, extra=[Watch()], max_grad_norm=1.0)
    (found,) = anomalies(cb)
    assert found.step == 5 and found.kind == "gradient" and found.action == "zero_grads"
    assert "transformer.h.0.attn.c_attn.weight" in found.message
    assert seen["bad"] == 0.0, "the Inf gradient is zeroed"
    assert 0.0 < seen["rest"] < math.inf, "the other gradients reach the optimizer, finite and not zeroed by the clip"
    assert cb.result.zeroed_grads == 1 and finite(model)
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert math.isinf(logged[5]["grad_norm"]), "the log shows the norm the guard read, not the Trainer's"


def test_poisoned_weights_are_restored_from_the_last_snapshot(tmp_path):
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    WeightFault(opt, model.transformer.h[0].mlp.c_fc.weight, (0, 0), steps=[6])
    cb = SafeTrainingCallback({**QUIET, "snapshot": {"every": 3}})
    trainer = Trainer(
        model=model, args=args(tmp_path, 10), train_dataset=Tokens(), callbacks=[cb], optimizers=(opt, None)
    )
    trainer.train()
    (found,) = anomalies(cb)
    assert found.step == 7 and found.kind == "weights" and found.action == "restore"
    assert "transformer.h.0.mlp.c_fc.weight" in found.message
    assert cb.result.restores == 1 and finite(model) and cb.result.ended == "done"


def test_a_loss_spike_is_skipped(tmp_path):
    model = gpt2()
    OutputFault(model.lm_head, calls=[26], value=300.0)  # the logits x300 at step 26 (a spike is not replayed)
    cb, moves, _ = train(model, tmp_path, 28, data=Tokens(n=96))
    (found,) = anomalies(cb)
    assert found.step == 26 and found.kind == "spike" and found.action == "skip_batch"
    assert moves.moved[26] is False and finite(model)


def test_an_unfixable_fault_stops_training_cleanly_with_the_exception_kept(tmp_path, caplog):
    """``on_abort="stop"``: ``train()`` returns, the exception kept (the default raises it: see
    tests/integration/test_callbacks_agree.py)."""
    model = gpt2()
    OutputFault(model.transformer.h[0].attn.c_proj, calls=range(5, 10**9))
    cb, moves, trainer = train(model, tmp_path, 30, {"recovery": {"max_retries": 2}}, on_abort="stop")
    assert isinstance(cb.aborted, TrainingAborted) and trainer.state.global_step < 30
    with pytest.raises(TrainingAborted):
        cb.raise_if_aborted()
    assert finite(model) and cb.result.ended == "aborted"
    assert moves.moved[trainer.state.global_step] is False, "the optimizer step after the abort changed nothing"
    assert ended(tmp_path)["action"] == "aborted"
    assert any("training stopped at step" in r.message for r in caplog.records)


def test_gradient_accumulation_decides_once_per_optimizer_step(tmp_path):
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[9, 10, 11, 12])  # step 5's first micro-batch and its replay
    cb, moves, trainer = train(model, tmp_path, 8, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    (found,) = anomalies(cb)
    assert found.step == 5 and found.kind == "forward"
    assert cb.result.steps == trainer.state.global_step == 8 and moves.moved[5] is False
    assert cb.result.optimizer_steps == 7 and finite(model)


def test_with_accumulation_the_judged_loss_is_the_steps_loss_for_a_model_given_num_items_in_batch(tmp_path):
    """Review of #19: GPT-2 takes ``num_items_in_batch``, so each micro-batch's loss is already
    divided by the whole step's token count and the step's loss is their sum. 9 batches an epoch
    with gradient_accumulation_steps=4: windows of 4, 4, 1. The guard's loss (judged for spikes,
    in metrics.csv and the journal) must be the step's loss the Trainer logs, not a quarter of it
    in full windows and four times that in the epoch's last (one micro-batch) window."""
    model = gpt2()
    seen: Dict[int, float] = {}

    class Judged(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen[state.global_step] = cb_ref[0].guard.last_loss

    cb_ref: List[SafeTrainingCallback] = []
    cb = SafeTrainingCallback(QUIET)
    cb_ref.append(cb)
    kw = dict(gradient_accumulation_steps=4, per_device_train_batch_size=4, logging_steps=1)
    trainer = Trainer(model=model, args=args(tmp_path, 6, **kw), train_dataset=Tokens(n=36), callbacks=[cb, Judged()])
    trainer.train()
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert sorted(logged) == sorted(seen) == [1, 2, 3, 4, 5, 6]
    for step, loss in logged.items():
        assert seen[step] == pytest.approx(loss, rel=1e-3, abs=1e-3), (step, seen, logged)


class Classifier(torch.nn.Module):
    """A plain module whose forward takes no ``**kwargs``: the Trainer divides its loss by the
    micro-batches of each accumulation window (fewer in an epoch's last one)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> Dict[str, Any]:
        logits = self.head(self.emb(input_ids).mean(dim=1))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_a_retry_in_an_epochs_last_short_accumulation_window_divides_as_the_trainer_does(tmp_path):
    """Review of #19: 9 batches an epoch, gradient_accumulation_steps=4: windows of 4, 4 and 1
    micro-batches, the Trainer dividing each loss by 4, 4 and 1. A transient NaN in the last
    window's forward is retried by the guard: its re-run must divide by 1 too, so the run ends
    bitwise as the same run without the fault and without safetrain (not with a quarter step)."""
    kw = dict(gradient_accumulation_steps=4, per_device_train_batch_size=4, lr_scheduler_type="constant")
    data = Tokens(n=36, classify=True)
    plain = Classifier()
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    Trainer(model=plain, args=args(tmp_path / "plain", 3, **kw), train_dataset=data, optimizers=(opt, None)).train()
    model = Classifier()
    OutputFault(model.head, calls=[9])  # the last window's only forward (the replay's and the retry's are clean)
    cb = SafeTrainingCallback(QUIET)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    Trainer(
        model=model, args=args(tmp_path, 3, **kw), train_dataset=data, callbacks=[cb], optimizers=(opt, None)
    ).train()
    assert [(e.step, e.kind, e.action) for e in anomalies(cb)] == [(3, "forward", "retry")]
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b), "the retried step's gradients are the Trainer's own"


def test_bf16_autocast_on_the_cpu(tmp_path):
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[4, 5, 6])
    cb, moves, trainer = train(model, tmp_path, 6, bf16=True)
    (found,) = anomalies(cb)
    assert found.step == 4 and found.kind == "forward" and moves.moved[4] is False
    assert finite(model) and cb.result.optimizer_steps == 5


def fp16_trainer(model: torch.nn.Module, out: Path, steps: int, callbacks: List[Any]) -> Trainer:
    """fp16 as on a GPU: accelerate makes no GradScaler on the CPU, so one is given to it (the
    Trainer's backward scales the loss, its clip unscales, its optimizer step steps and updates it)."""
    trainer = Trainer(model=model, args=args(out, steps, fp16=True), train_dataset=Tokens(), callbacks=callbacks)
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer.accelerator.native_amp = True
    return trainer


def test_fp16_the_guard_and_the_trainer_share_the_scaler_and_unscale_once(tmp_path):
    """The guard unscales before it reads; the Trainer's clip does not unscale again (the same
    update as without safetrain, bitwise), and a skipped step is an overflow for the scaler."""
    plain = gpt2()
    fp16_trainer(plain, tmp_path / "plain", 5, []).train()
    model = gpt2()
    cb = SafeTrainingCallback(QUIET)
    fp16_trainer(model, tmp_path / "guarded", 5, [cb]).train()
    assert cb.result.healthy_steps == 5
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b), "gradients unscaled once, as without safetrain"
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[3, 4, 5])
    cb, moves = SafeTrainingCallback(QUIET), Moves(model)
    trainer = fp16_trainer(model, tmp_path / "fault", 6, [cb, moves])
    trainer.train()
    (found,) = anomalies(cb)
    assert found.step == 3 and found.kind == "forward" and moves.moved[3] is False
    assert trainer.accelerator.scaler.get_scale() == 2.0**9, "the scaler skipped the step and lowered its scale"
    assert "unscale_" not in vars(trainer.accelerator.scaler), "the scaler is put back at the end"
    assert finite(model) and trainer.lr_scheduler.last_epoch == 5


def test_the_scheduler_follows_optimizer_steps_and_keeps_an_lr_backoff(tmp_path):
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[3, 4, 5])

    class Backoff(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 6:
                cb_ref[0].guard.recovery.lr_changed(0.5, "test: a backoff")

    cb_ref: List[SafeTrainingCallback] = []
    cb = SafeTrainingCallback(QUIET)
    cb_ref.append(cb)
    trainer = Trainer(model=model, args=args(tmp_path, 10), train_dataset=Tokens(), callbacks=[cb, Backoff()])
    trainer.train()
    sched, opt = trainer.lr_scheduler, trainer.optimizer
    assert sched.last_epoch == 9, "10 steps, one skipped: the linear schedule moved 9 times"
    unscaled = 1e-3 * (10 - 9) / 10
    assert sched.get_last_lr()[0] == pytest.approx(unscaled)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * unscaled), "the backoff survives the scheduler"


@pytest.mark.parametrize("restore_callbacks", [False, True])
def test_resume_from_the_trainers_checkpoint_restores_the_guards_state(tmp_path, restore_callbacks, monkeypatch):
    """Also with restore_callback_states_from_checkpoint, where the Trainer makes a new callback
    from the checkpoint's args (the config) and attributes (the guard's state)."""
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=[3, 4, 5])

    class Backoff(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 6:
                first.guard.recovery.lr_changed(0.5, "test: a backoff")

    first = SafeTrainingCallback(QUIET)
    kw = dict(
        save_strategy="steps",
        save_steps=8,
        lr_scheduler_type="constant",
        restore_callback_states_from_checkpoint=restore_callbacks,
    )
    Trainer(model=model, args=args(tmp_path, 8, **kw), train_dataset=Tokens(), callbacks=[first, Backoff()]).train()
    assert (tmp_path / "checkpoint-8").is_dir()
    saved = first.result
    model2 = gpt2()
    second = SafeTrainingCallback(QUIET)
    trainer = Trainer(model=model2, args=args(tmp_path, 12, **kw), train_dataset=Tokens(), callbacks=[second])
    first_forward: List[torch.Tensor] = []  # the RNG state the resumed run trains its first step with
    model2.register_forward_pre_hook(lambda m, a: first_forward.append(torch.get_rng_state()) if m.training else None)
    forced: List[torch.Tensor] = []
    snapshot = Guard.snapshot

    def spy(guard: Guard, force: bool = False) -> Any:
        if force:
            forced.append(torch.get_rng_state())
        return snapshot(guard, force)

    monkeypatch.setattr(Guard, "snapshot", spy)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-8"))
    assert len(forced) == 1 and torch.equal(forced[0], first_forward[0]), (
        "the resume's snapshot holds the checkpoint's RNG state (a restore to it replays the same dropout)"
    )
    (used,) = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, SafeTrainingCallback)]
    assert (used is second) is not restore_callbacks
    assert used.cfg.detect.check_weights_every == 0, "the config came back with it"
    r = used.result
    assert r.steps == 12 and r.skipped_batches == saved.skipped_batches == 1
    assert r.healthy_steps == saved.healthy_steps + 4 and r.lr_scale == 0.5
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3), "the LR scale came back"
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["action"] for e in events if e["event"] == "run_started"] == ["start", "resume"]


def test_one_host_sync_per_healthy_step_inside_the_callback(tmp_path):
    """Counted inside the callback's own work only (its hooks on the model, the decision at the end
    of the backward, its Trainer events); the Trainer's own syncs (its NaN filter on the logged loss,
    its logging) are its own, with or without safetrain."""
    model = gpt2()
    cb = SafeTrainingCallback({**QUIET, "snapshot": {"every": 1000}})
    inside = {"syncs": 0, "steps": 0}
    counter: List[Any] = []

    def counted(fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            if not counter:
                return fn(*a, **k)
            before = counter[0].count
            try:
                return fn(*a, **k)
            finally:
                inside["syncs"] += counter[0].count - before

        return wrapper

    for name in ("_before_forward", "_after_forward", "_decide", "on_pre_optimizer_step", "on_step_end", "on_log"):
        setattr(cb, name, counted(getattr(cb, name)))

    class Count(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2 and not counter:  # the first steps (the forced snapshot) are not counted
                counter.append(ctx.__enter__())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            inside["steps"] += bool(counter)

    ctx = count_host_syncs()
    trainer = Trainer(model=model, args=args(tmp_path, 12), train_dataset=Tokens(), callbacks=[cb, Count()])
    try:
        trainer.train()
    finally:
        if counter:
            ctx.__exit__(None, None, None)
    assert anomalies(cb) == [] and inside["steps"] == 10
    assert inside["syncs"] == inside["steps"], inside


def test_eval_forwards_pass_through_and_the_hooks_come_off(tmp_path):
    model = gpt2()
    cb = SafeTrainingCallback(QUIET)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, 4, eval_strategy="steps", eval_steps=2),
        train_dataset=Tokens(),
        eval_dataset=Tokens(n=16, seed=2),
        callbacks=[cb],
    )
    trainer.train()
    assert cb.result.steps == 4 and anomalies(cb) == []
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_loss_computed_outside_the_model_is_refused_clearly_and_close_ends_the_journal(tmp_path):
    """A compute_loss_func takes the labels away from the model: no output.loss to guard."""
    model = gpt2()
    cb = SafeTrainingCallback(QUIET)
    trainer = Trainer(
        model=model,
        args=args(tmp_path, 3),
        train_dataset=Tokens(),
        callbacks=[cb],
        compute_loss_func=lambda out, labels, num_items_in_batch=None: out.logits.mean(),
    )
    with pytest.raises(RuntimeError, match="no loss; expected the model to compute it") as caught:
        trainer.train()
    cb.close(error=caught.value)
    assert ended(tmp_path)["action"] == "failed" and not model._forward_hooks


def test_import_safetrain_imports_no_framework_and_old_transformers_is_refused(monkeypatch):
    code = "import safetrain, sys; assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.40.2")
    with pytest.raises(RuntimeError, match=r"transformers>=4.46.*4\.40\.2"):
        hf._require_transformers()


def test_the_example_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_trainer_callback.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recovered" in out.stdout, out.stdout


def test_a_run_dir_another_run_holds_is_refused_at_once_and_let_go_after(tmp_path):
    """Issue 26: one run per run directory, for the callback too (its RunWriters lock the run dir)."""
    from safetrain.rundir import RunDirBusy, lock_run_dir

    held = lock_run_dir(tmp_path)
    try:
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} on host "):
            train(gpt2(), tmp_path, 2)
        assert not (tmp_path / "events.jsonl").exists(), "refused before writing the journal"
    finally:
        held.release()
    cb, _, _ = train(gpt2(), tmp_path, 2)
    assert ended(tmp_path)["action"] == "done" and cb.result.ended == "done"
    lock_run_dir(tmp_path).release()  # the finished run let it go


def test_a_schedule_bug_is_held_after_the_restore_and_not_re_installed(tmp_path):
    """Issue 23, point 6, in the Hugging Face callback: a LambdaLR at 1000x for scheduler steps 5..7
    (the snapshot of step 5 holds it). One update at 1000x, then the restore holds the schedule
    to the last healthy update's LR; the run ends done below its starting loss, at LR scale 1 (before:
    updates at x1000, x500, x250 and "done" at a loss above the start)."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1000.0 if 5 <= s < 8 else 1.0)
    used: List[float] = []

    def record(o: Any, a: Any, k: Any) -> None:  # an update (a dropped step has no gradients)
        if any(p.grad is not None for g in o.param_groups for p in g["params"]):
            used.append(o.param_groups[0]["lr"])

    opt.register_step_post_hook(record)
    data = Tokens()
    batch = {k: torch.stack([data[i][k] for i in range(len(data))]) for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        start = model(**batch).loss.item()
    cb = SafeTrainingCallback({**QUIET, "snapshot": {"every": 5}, "guard": {"spike": {"min_history": 4}}})
    Trainer(model=model, args=args(tmp_path, 30), train_dataset=data, callbacks=[cb], optimizers=(opt, sched)).train()
    assert sum(lr > 1e-3 * 1.001 for lr in used) == 1, used
    assert cb.result.ended == "done" and cb.result.lr_scale == 1.0, cb.result
    assert any(e.name == "lr_changed" and "LambdaLR" in e.message for e in cb.result.events)
    with torch.no_grad():
        assert model(**batch).loss.item() < start
