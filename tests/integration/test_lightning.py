"""The Lightning callback against real Lightning (issue #19): a ``Trainer`` with automatic
optimization, its accumulation, clipping, precision plugins, schedulers and checkpoints, the guard
told at Lightning's hooks. Each fault is detected at its step and layer, the action carried out
(a skipped step moves no parameter although Lightning calls ``optimizer.step()``), and training
ends with finite parameters; one host sync per healthy step inside the callback."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

from safetrain import Guard, TrainingAborted, load_config  # noqa: E402
from safetrain.guard import Phase  # noqa: E402
from safetrain.integrations.lightning import SafeTrainingCallback  # noqa: E402
from safetrain.testing import GradFault, OutputFault, PoisonRows, WeightFault, count_host_syncs  # noqa: E402
from tests.helpers.gan import d_loss, g_loss, gan_and_optimizers  # noqa: E402
from tests.helpers.lightning import CFG, Collect, Net, images, loader, trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def finite(model: torch.nn.Module) -> bool:
    return bool(torch.isfinite(flat(model)).all())


def journal(tmp: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in (tmp / "safetrain" / "events.jsonl").read_text().splitlines()]


def anomalies(tmp: Path) -> List[Dict[str, Any]]:
    return [e for e in journal(tmp) if e["event"] == "anomaly"]


class Moves(pl.Callback):
    """Whether each optimizer step moved the parameters (compared around Lightning's own step)."""

    def __init__(self) -> None:
        self.moved: List[bool] = []
        self.stats_moved: List[bool] = []  # BatchNorm's running mean, from before the step's forward
        self._before: Optional[torch.Tensor] = None
        self._stats: Optional[torch.Tensor] = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._stats is None:
            self._stats = pl_module.bn.running_mean.clone()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._before = flat(pl_module).clone()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._before is not None:
            self.moved.append(not torch.equal(self._before, flat(pl_module)))
            self.stats_moved.append(not torch.equal(self._stats, pl_module.bn.running_mean))
            self._before = self._stats = None


def fit(
    model: Net,
    tmp: Path,
    cfg: Optional[dict] = None,
    data: Any = None,
    max_steps: int = 8,
    extra: Optional[list] = None,
    **kw: Any,
) -> SafeTrainingCallback:
    cb = SafeTrainingCallback({**CFG, **(cfg or {})})
    t = trainer(cb, tmp, max_steps=max_steps, **kw)
    for c in extra or []:
        t.callbacks.append(c)
    t.fit(model, loader(data))
    return cb


def test_a_healthy_run_of_100_steps_with_batchnorm_has_no_false_positive(tmp_path):
    """Validation runs every epoch (its forwards pass through the guard's hooks) and changes nothing."""
    model, cb, log = Net(), SafeTrainingCallback(CFG), Collect()
    t = trainer(cb, tmp_path, max_steps=104, limit_val_batches=2, logger=log, log_every_n_steps=25)
    t.fit(model, loader(), loader())
    norms = [(step, m["safetrain/grad_norm"]) for step, m in log.rows if "safetrain/grad_norm" in m]
    assert [step for step, _ in norms] == [24, 49, 74, 99], "every log_every_n_steps steps"
    assert all(math.isfinite(v) and v > 0 for _, v in norms)
    c = cb.guard.counters
    assert c.steps == 104 and c.optimizer_steps == 104 and c.healthy_steps == 104, vars(c)
    assert anomalies(tmp_path) == []
    events = journal(tmp_path)
    assert events[0]["event"] == "run_started" and events[-2]["event"] == "run_ended", [e["event"] for e in events]
    assert events[-2]["action"] == "done" and cb.result.ended == "done"
    assert finite(model) and cb.guard.phase is Phase.CLOSED, "the guard's hooks came off the model"


def steps_of(tmp: Path, kind: str) -> List[Dict[str, Any]]:
    return [e for e in anomalies(tmp) if e["kind"] == kind]


def test_a_nan_input_row_is_dropped_and_training_step_never_sees_it(tmp_path):
    """Row 21 (3rd batch) holds NaN: the scan zero-fills it in the batch Lightning hands to
    training_step (BatchNorm's statistics stay finite), the guard re-runs the step without it."""
    model = Net()
    cb = fit(model, tmp_path, data=PoisonRows(images(), indices=[21]))
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("input", 3, "drop_rows"), found
    assert cb.guard.counters.dropped_rows == 1 and cb.guard.counters.optimizer_steps == 8
    assert finite(model) and bool(
        torch.isfinite(model.bn.running_mean).all() & torch.isfinite(model.bn.running_var).all()
    )


def test_a_layer_emitting_nan_once_is_found_in_that_layer_and_the_step_retried(tmp_path):
    model = Net()
    OutputFault(model.conv, calls=[3])
    cb = fit(model, tmp_path)
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("forward", 3, "retry")
    assert found["detail"]["finding"]["module"] == "conv"
    assert cb.guard.counters.retries == 1 and cb.guard.counters.optimizer_steps == 8 and finite(model)


def test_an_inf_gradient_skipped_does_not_move_a_parameter_though_lightning_steps(tmp_path):
    model, moves = Net(), Moves()
    GradFault(model.head.weight, calls=[4])
    cfg = {"recovery": {"actions": {"gradient": "skip_batch"}}, "detect": {"replay": {"enabled": False}}}
    cb = fit(model, tmp_path, cfg, extra=[moves], logger=(log := Collect()))
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("gradient", 4, "skip_batch"), found
    assert [(step, m["safetrain/trained"]) for step, m in log.rows if "safetrain/trained" in m] == [(3, 0.0)]
    assert "head.weight" in json.dumps(found["detail"])
    assert moves.moved == [True] * 3 + [False] + [True] * 4, "the skipped step moved no parameter"
    assert moves.stats_moved == moves.moved, "nor BatchNorm's running statistics"
    assert cb.guard.counters.skipped_batches == 1 and finite(model)


def test_an_inf_gradient_by_default_is_replayed_found_transient_and_retried_through_training_step(tmp_path):
    model = Net()
    GradFault(model.head.weight, calls=[4])
    cb = fit(model, tmp_path)
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("gradient", 4, "retry"), found
    assert cb.guard.counters.retries == 1 and cb.guard.counters.optimizer_steps == 8 and finite(model)


def test_persistent_inf_gradients_are_zeroed_and_the_step_takes_the_rest(tmp_path):
    """The fault never goes: after the zeroed step the ladder restores the run's only snapshot, its
    start's, and the run ends there, none of its training kept: not "done" (issue #32)."""
    model = Net()
    GradFault(model.head.weight, calls=range(4, 10**9))
    cb = SafeTrainingCallback({**CFG, "detect": {"replay": {"enabled": False}}})
    with pytest.raises(TrainingAborted, match="the run ended restored to its start"):
        trainer(cb, tmp_path, max_steps=5).fit(model, loader())
    (found,) = anomalies(tmp_path)[:1]
    assert (found["kind"], found["step"], found["action"]) == ("gradient", 4, "zero_grads"), found
    assert cb.guard.counters.zeroed_grads >= 1 and finite(model)


class Poison(pl.Callback):
    """A WeightFault on the trainer's optimizer (made in configure_optimizers)."""

    def __init__(self, steps: List[int]) -> None:
        self.steps = steps

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        WeightFault(trainer.optimizers[0], pl_module.conv.weight, (0, 0, 0, 0), steps=self.steps)


def test_poisoned_weights_are_restored_from_the_last_good_snapshot(tmp_path):
    model = Net()
    cb = fit(model, tmp_path, extra=[Poison([6])], max_steps=10)
    found = anomalies(tmp_path)[0]
    assert (found["kind"], found["step"], found["action"]) == ("weights", 7, "restore"), found
    assert "conv.weight" in json.dumps(found["detail"])
    assert cb.guard.counters.restores == 1 and finite(model)


def test_after_a_restore_the_batches_to_skip_run_through_training_step_and_train_nothing(tmp_path):
    model, moves = Net(), Moves()
    cfg = {"recovery": {"skip_batches_after_restore": 1}}
    cb = fit(model, tmp_path, cfg, extra=[Poison([6]), moves], max_steps=10)
    assert [(e["kind"], e["step"], e["action"]) for e in anomalies(tmp_path)][:1] == [("weights", 7, "restore")]
    assert moves.moved[7] is False and moves.moved[8] is True, moves.moved
    assert cb.guard.counters.restores == 1 and finite(model)


class EpochNet(Net):
    """Net with an epoch-interval StepLR that halves the LR at each epoch's end."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


class LRs(pl.Callback):
    """The LR each batch trains with."""

    def __init__(self) -> None:
        self.lrs: List[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_a_restore_across_an_epoch_end_keeps_the_lr_of_the_epoch_interval_scheduler(tmp_path):
    """Review of #19: the snapshot of step 5 (epoch 0, LR 0.05) is restored at step 10 (epoch 1).
    The epoch-interval scheduler is not in the snapshot and stays at epoch 1: the LR must stay
    its 0.025, not go back to 0.05 (a chained StepLR then lags one epoch for the rest of the run)."""
    model, lrs = EpochNet(), LRs()
    fit(model, tmp_path, extra=[Poison([9]), lrs], max_steps=20)
    assert [(e["kind"], e["step"], e["action"]) for e in anomalies(tmp_path)] == [("weights", 10, "restore")]
    assert lrs.lrs == [0.05] * 8 + [0.025] * 8 + [0.0125] * 4, lrs.lrs


def test_the_data_skipped_after_a_restore_at_an_epochs_short_last_window_is_one_step(tmp_path):
    """Review of #19: accumulation 3, 8 batches an epoch (windows of 3, 3, 2). Weights poisoned by
    step 1 are restored at step 2; the one step to skip after it is the epoch's short last window:
    it counts as one skipped step, and the next epoch's first window trains (before: its 2
    micro-batches were counted towards a step of 3, the next window was skipped as well and the
    guard's steps fell behind Lightning's)."""
    model, moves = Net(), Moves()
    cfg = {"recovery": {"skip_batches_after_restore": 1}}
    cb = fit(model, tmp_path, cfg, extra=[Poison([1]), moves], max_steps=5, accumulate_grad_batches=3)
    assert [(e["kind"], e["step"], e["action"]) for e in anomalies(tmp_path)][:1] == [("weights", 2, "restore")]
    assert moves.moved == [True, False, False, True, True], moves.moved
    c = cb.guard.counters
    assert (c.steps, c.skipped_batches, c.restores) == (5, 2, 1), vars(c)


def test_a_loss_spike_is_skipped(tmp_path):
    model, moves = Net(), Moves()
    OutputFault(model.head, calls=[8], value=1e4)  # a finite blow-up of the logits at the 8th forward
    cfg = {"detect": {"replay": {"enabled": False}}}
    cb = fit(model, tmp_path, cfg, extra=[moves], max_steps=10)
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("spike", 8, "skip_batch"), found
    assert moves.moved[7] is False and sum(moves.moved) == 9
    assert cb.guard.counters.skipped_batches == 1 and finite(model)


@pytest.mark.parametrize("on_abort", ["raise", "stop"])
def test_an_unfixable_fault_aborts_cleanly_at_the_last_good_state(tmp_path, on_abort):
    model = Net()
    OutputFault(model.conv, calls=range(4, 10**9))
    cb = SafeTrainingCallback({**CFG, "recovery": {"max_retries": 2}}, on_abort=on_abort)
    t = trainer(cb, tmp_path, max_steps=20)
    if on_abort == "raise":
        with pytest.raises(TrainingAborted):
            t.fit(model, loader())
    else:
        t.fit(model, loader())
        assert isinstance(cb.aborted, TrainingAborted) and t.should_stop
    assert finite(model) and cb.result.ended == "aborted"
    start = Net()  # steps 1-3 healthy, no snapshot since the forced one of step 0: that is the last good state
    assert torch.equal(flat(model), flat(start)) and torch.equal(model.bn.running_mean, start.bn.running_mean)
    ended = [e for e in journal(tmp_path) if e["event"] == "run_ended"]
    assert [e["action"] for e in ended] == ["aborted"]
    assert t.global_step < 20


def test_gradient_accumulation_and_clipping_leave_a_healthy_run_bitwise_as_without_the_callback(tmp_path):
    """The guard changes nothing on a healthy run: the same parameters as plain Lightning, with
    accumulate_grad_batches=2 and gradient_clip_val; the loss it judges is the step's mean."""
    kw = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    plain = Net()
    trainer(None, tmp_path / "plain", max_steps=6, **kw).fit(plain, loader())
    model = Net()
    model.keep = True
    cb = fit(model, tmp_path, max_steps=6, **kw)
    assert torch.equal(flat(model), flat(plain)) and torch.equal(model.bn.running_var, plain.bn.running_var)
    c = cb.guard.counters
    assert (c.steps, c.optimizer_steps, c.epoch, c.batch) == (6, 6, 1, 4) and anomalies(tmp_path) == []
    assert cb.guard.last_loss == pytest.approx(sum(model.seen[-2:]) / 2), "the step's loss: the mean, not divided"


def test_gradient_accumulation_skips_the_whole_optimizer_step_of_a_bad_micro_batch(tmp_path):
    model, moves = Net(), Moves()
    GradFault(model.head.weight, calls=[5])  # the 3rd optimizer step's first micro-batch
    cfg = {"recovery": {"actions": {"gradient": "skip_batch"}}, "detect": {"replay": {"enabled": False}}}
    fit(model, tmp_path, cfg, extra=[moves], max_steps=4, accumulate_grad_batches=2)
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("gradient", 3, "skip_batch")
    assert moves.moved == [True, True, False, True] and moves.stats_moved == moves.moved


class Backoff(pl.Callback):
    """An LR backoff of 0.5 before the given batch (as the policy's scale_lr sets it)."""

    def __init__(self, cb: SafeTrainingCallback, at: int) -> None:
        self.cb, self.at = cb, at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.at:
            self.cb.guard.recovery.lr_changed(0.5, "test: a backoff")


def test_a_step_interval_scheduler_follows_optimizer_steps_and_keeps_the_lr_backoff(tmp_path):
    model = Net(sched="step")
    GradFault(model.head.weight, calls=[3])
    cfg = {**CFG, "recovery": {"actions": {"gradient": "skip_batch"}}, "detect": {"replay": {"enabled": False}}}
    cb = SafeTrainingCallback(cfg)
    t = trainer(cb, tmp_path, max_steps=8)
    t.callbacks.append(Backoff(cb, at=5))
    t.fit(model, loader())
    sched = t.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 7, "8 optimizer steps, one skipped: the schedule moved 7 times"
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.9**7 * 0.5)
    assert cb.guard.backoff.unscaled == pytest.approx([0.05 * 0.9**7])


def test_resume_from_a_lightning_checkpoint_restores_the_guard_counters_and_lr_scale(tmp_path):
    model = Net(sched="step")
    GradFault(model.head.weight, calls=[3])
    cfg = {**CFG, "recovery": {"actions": {"gradient": "skip_batch"}}, "detect": {"replay": {"enabled": False}}}
    cb = SafeTrainingCallback(cfg)
    t = trainer(cb, tmp_path, max_steps=6)
    t.callbacks.append(Backoff(cb, at=4))
    t.fit(model, loader())
    t.save_checkpoint(tmp_path / "last.ckpt")
    assert cb.guard.counters.skipped_batches == 1 and cb.guard.backoff.scale == 0.5
    lr = t.optimizers[0].param_groups[0]["lr"]

    again = SafeTrainingCallback(cfg)
    t2 = trainer(again, tmp_path / "2", max_steps=10)
    t2.fit(Net(sched="step"), loader(), ckpt_path=str(tmp_path / "last.ckpt"))
    c = again.guard.counters
    assert (c.steps, c.optimizer_steps, c.skipped_batches) == (10, 9, 1), vars(c)
    assert again.guard.backoff.scale == 0.5, "the LR backoff came back"
    sched = t2.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 9 and lr == pytest.approx(0.05 * 0.9**5 * 0.5)
    assert t2.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.9**9 * 0.5), "not compounded"
    assert journal(tmp_path / "2")[0]["action"] == "resume"


def test_bf16_mixed_precision_runs_under_the_guard_with_the_same_autocast(tmp_path):
    model = Net()
    OutputFault(model.conv, calls=[3])
    cb = fit(model, tmp_path, max_steps=6, precision="bf16-mixed")
    assert cb.guard.cfg.amp.dtype == "bfloat16" and cb.guard.scaler is None
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("forward", 3, "retry")
    assert cb.guard.counters.optimizer_steps == 6 and finite(model)


def test_16_mixed_uses_lightnings_grad_scaler_and_judges_the_unscaled_loss(tmp_path):
    """Trainer(precision="16-mixed") on CPU becomes bf16-mixed in Lightning 2.6 (with a warning);
    its fp16 plugin given explicitly runs fp16 autocast with its GradScaler on CPU: the guard reads
    that scaler, and the loss it judges is training_step's, not Lightning's scaled one."""
    from lightning.pytorch.plugins import MixedPrecision

    model = Net()
    model.keep = True
    OutputFault(model.conv, calls=[3])
    cb = SafeTrainingCallback(CFG)
    fp16 = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    t = trainer(cb, tmp_path, max_steps=6, plugins=[fp16])
    t.fit(model, loader())
    assert cb.guard.scaler is t.precision_plugin.scaler is not None and cb.guard.cfg.amp.dtype == "float16"
    assert cb.guard.last_loss == pytest.approx(model.seen[-1], rel=1e-3), (cb.guard.last_loss, model.seen[-1])
    (found,) = anomalies(tmp_path)
    assert (found["kind"], found["step"], found["action"]) == ("forward", 3, "retry")
    assert cb.guard.counters.optimizer_steps == 6 and finite(model)


def test_one_host_sync_per_healthy_step_inside_the_callback(tmp_path):
    """Counted around the callback's hooks only (Lightning syncs for its own logging and loop)."""
    syncs: List[int] = []

    class Counted(SafeTrainingCallback):
        pass

    def counting(hook: Any) -> Any:
        def counted(self: Any, *args: Any, **kw: Any) -> Any:
            if self.guard is None or self.guard.counters.steps < 2:  # the first step's forced snapshot
                return hook(self, *args, **kw)
            with count_host_syncs() as n:
                out = hook(self, *args, **kw)
            syncs.append(n.count)
            return out

        return counted

    for name in ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"):
        setattr(Counted, name, counting(getattr(SafeTrainingCallback, name)))
    cb = Counted({**CFG, "snapshot": {"every": 1000}})
    trainer(cb, tmp_path, max_steps=12).fit(Net(), loader())
    assert anomalies(tmp_path) == [] and cb.guard.counters.healthy_steps == 12
    steps = 12 - 2
    assert sum(syncs) == steps, (sum(syncs), steps)


def test_resume_from_a_model_checkpoint_saved_mid_run(tmp_path):
    """ModelCheckpoint saves after the callback's on_train_batch_end: the checkpoint of step 6
    holds the guard at step 6, and the resumed run goes on from there."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = Net()
    GradFault(model.head.weight, calls=[2])
    cfg = {**CFG, "recovery": {"actions": {"gradient": "skip_batch"}}, "detect": {"replay": {"enabled": False}}}
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    t = trainer(SafeTrainingCallback(cfg), tmp_path, max_steps=8, enable_checkpointing=True)
    t.callbacks.append(saver)
    t.fit(model, loader())
    ckpt = torch.load(tmp_path / "ckpt" / "epoch=0-step=6.ckpt", weights_only=False)
    (state,) = [v for k, v in ckpt["callbacks"].items() if "SafeTrainingCallback" in k]
    assert state["guard"]["counters"]["steps"] == 6 and state["guard"]["counters"]["skipped_batches"] == 1
    again = SafeTrainingCallback(cfg)
    trainer(again, tmp_path / "2", max_steps=8).fit(
        Net(), loader(), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=6.ckpt"
    )
    assert (again.guard.counters.steps, again.guard.counters.skipped_batches) == (8, 1)


class Manual(Net):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused_naming_what_to_use_instead(tmp_path):
    """Manual optimization (Lightning's way to write a GAN) is refused at start, and the sentence
    says what to do: a Guard with named steps in training_step."""
    with pytest.raises(ValueError, match=r"automatic_optimization = False.*safetrain\.Guard.*name='d'"):
        trainer(SafeTrainingCallback(CFG), tmp_path, max_steps=2).fit(Manual(), loader())


def test_import_safetrain_imports_no_lightning():
    code = "import sys, safetrain; assert 'lightning' not in sys.modules and 'pytorch_lightning' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_readme_snippet_with_the_csv_logger_keeps_the_loggers_file_its_own(tmp_path):
    """Issue 25: with ``pip install lightning`` (no tensorboard) Lightning falls back to its CSV logger,
    whose ``metrics.csv`` sits in ``trainer.log_dir``; the callback's journal and metrics go to its
    own ``safetrain/`` there (both files appended to one ``metrics.csv`` before), the logger's file
    gets the LR in force and the counters, and ``safetrain report`` reads the run from the logger's
    directory."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from safetrain.rundir.runlog import read_run

    model = Net()
    OutputFault(model.conv, calls=[3])
    cb = SafeTrainingCallback(CFG)
    trainer(cb, tmp_path, logger=CSVLogger(tmp_path), log_every_n_steps=4).fit(model, loader())
    version = tmp_path / "lightning_logs" / "version_0"
    rows = list(csv.DictReader((version / "metrics.csv").open()))
    assert rows and "trained" not in rows[0] and all(None not in r for r in rows), rows[:2]
    acted = [r for r in rows if r.get("safetrain/retries") == "1.0"]
    assert acted and acted[0]["step"] == "2" and float(acted[0]["safetrain/lr"]) == 0.05, rows
    run = read_run(version)
    assert run.metrics is not None and run.metrics["step"] == [float(s) for s in range(1, 9)]
    assert [e["kind"] for e in anomalies(version)] == ["forward"]


def test_a_run_dir_another_run_holds_is_refused_at_once_and_let_go_after(tmp_path):
    """Issue 26: one run per run directory, for the callback too (its RunWriters lock the run dir)."""
    import os

    from safetrain.rundir import RunDirBusy, lock_run_dir

    (tmp_path / "safetrain").mkdir()  # the callback's own subdirectory of Lightning's log dir
    held = lock_run_dir(tmp_path / "safetrain")
    try:
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()} on host "):
            fit(Net(), tmp_path)
        assert not (tmp_path / "safetrain" / "events.jsonl").exists(), "refused before writing the journal"
    finally:
        held.release()
    cb = fit(Net(), tmp_path)
    assert cb.result.ended == "done"
    lock_run_dir(tmp_path / "safetrain").release()  # the finished run let it go


class SpikyNet(Net):
    """Net with a step-interval LambdaLR that returns 1000x the LR at scheduler steps 5, 6 and 7 (a
    schedule bug): the snapshot of step 5 is taken right after it set 1000x for update 6. Every
    update's LR is recorded by an optimizer step post-hook."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        self.used: List[float] = []
        opt.register_step_post_hook(self._record)  # (after Lightning's closure ran the backward)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1000.0 if 5 <= s < 8 else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _record(self, opt: Any, args: Any, kwargs: Any) -> None:
        """The LR of an update (Lightning calls the step after a dropped one too: it moves nothing)."""
        if any(p.grad is not None for group in opt.param_groups for p in group["params"]):
            self.used.append(opt.param_groups[0]["lr"])


def test_a_schedule_bug_is_held_after_the_restore_and_not_re_installed(tmp_path):
    """Issue 23, point 6, in the Lightning callback: one update at 1000x (nothing could see it
    coming), then the restore holds the scheduler to the last healthy update's LR however often it
    computes 1000x again; the run ends done, trained, at LR scale 1, the journal naming LambdaLR."""
    model = SpikyNet()
    x, y = images().tensors
    with torch.no_grad():
        start = F.cross_entropy(model(x), y).item()
    fit(model, tmp_path, {"guard": {"spike": {"min_history": 4}}}, max_steps=40)
    assert sum(lr > 0.05 * 1.001 for lr in model.used) == 1, model.used
    events = journal(tmp_path)
    assert any(e["event"] == "lr_changed" and "LambdaLR" in e["message"] for e in events), events
    ended = events[-1] if events[-1]["event"] == "run_ended" else next(e for e in events if e["event"] == "run_ended")
    assert ended["action"] == "done", ended
    with torch.no_grad():
        assert F.cross_entropy(model(x), y).item() < start


class ManualGAN(pl.LightningModule):
    """A GAN the Lightning way (manual optimization), guarded as the refusal above says: one Guard
    over both networks and Lightning's two optimizers, named steps in ``training_step``."""

    def __init__(self, log_dir: Path, fault_at: Optional[int] = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.nets, _ = gan_and_optimizers()
        self.log_dir, self.fault_at, self.results = log_dir, fault_at, []
        self.nets["d"][0].register_forward_hook(lambda m, a, out: out * math.nan if self.fault else out)
        self.fault = False

    def configure_optimizers(self) -> Any:
        return [torch.optim.Adam(self.nets[name].parameters(), 1e-3) for name in ("d", "g")]

    def on_train_start(self) -> None:
        opt_d, opt_g = self.optimizers()  # Lightning's wrappers: their step counts Lightning's global step
        more = ["snapshot.every=2", "recovery.actions.forward=restore", "detect.replay.enabled=false"]
        cfg = load_config(None, ["log.progress=false", f"log.dir={self.log_dir}", *more])
        self.guard = Guard(self.nets, {"d": opt_d, "g": opt_g}, cfg, step_fn={"d": d_loss, "g": g_loss})

    def training_step(self, batch: Any, batch_idx: int) -> None:
        for name in ("d", "g"):
            self.fault = batch_idx == self.fault_at and name == "d"
            self.results.append(self.guard.step(batch[0], name=name))
        self.fault = False

    def on_train_end(self) -> None:
        self.guard.close()


def test_a_manual_optimization_gan_is_guarded_with_named_steps(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(256, 2) * 0.3 + 1.0), batch_size=32)
    module = ManualGAN(tmp_path / "run", fault_at=5)
    trainer(None, tmp_path, max_steps=14).fit(module, data)
    restored = [r for r in module.results if r.restored]
    assert len(restored) == 1 and module.results.index(restored[0]) == 10  # batch 5's D step
    assert finite(module.nets) and module.guard.counts.optimizer_steps == len(module.results) - 1
