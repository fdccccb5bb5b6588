"""The engine's contracts: one host sync per healthy step, schedulers, resume, batch styles, AMP."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler as S

from safetrain import BatchError, SafeTrainer, load_config
from safetrain.guard import Guard
from safetrain.policy import Anomaly, History, Rules, decide
from safetrain.testing import GradFault, PoisonRows, count_host_syncs
from tests.helpers.engine import BASE, anomalies, fit
from tests.helpers.models import finite_params, loader, mlp, regression_data


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("amp", ["null", "float16", "bfloat16"])
def test_exactly_one_host_sync_per_healthy_step(mode, amp):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    cfg = load_config(
        None,
        [
            *BASE,
            f"detect.mode={mode}",
            f"amp.dtype={amp}",
            "guard.clip_grad_norm=1.0",
            "detect.check_weights_every=2",
            "snapshot.every=1000",
        ],
    )
    batches = list(loader(regression_data()))
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        guard.step(batches[0])  # the first step also takes the initial snapshot (its own sync)
        for batch in batches[1:6]:
            with count_host_syncs() as syncs:
                result = guard.step(batch)
            assert result is not None and result.action in ("", "skip_batch"), result
            if result.action == "":
                # Adam's single-tensor path calls .item() on its step counter, which torch keeps
                # on the CPU on purpose (not a device sync); every other read counts.
                ours = [c for c in syncs.calls if "torch/optim/" not in c[1]]
                assert len(ours) == 1, f"host syncs in a healthy step: {ours}"


def test_accumulation_syncs_once_per_optimizer_step_and_matches_big_batch():
    torch.manual_seed(0)
    data = regression_data(n=64)
    x, y = data.tensors
    big, small = mlp(), mlp()
    cfg = ["detect.mode=eager", "snapshot.every=1000"]
    g_big = Guard(big, torch.optim.SGD(big.parameters(), lr=0.1), load_config(None, [*BASE, *cfg]), loss_fn=F.mse_loss)
    g_small = Guard(
        small,
        torch.optim.SGD(small.parameters(), lr=0.1),
        load_config(None, [*BASE, *cfg, "guard.accumulate_steps=4"]),
        loss_fn=F.mse_loss,
    )
    g_small.snapshot(force=True)  # the initial snapshot (its finiteness check reads the host once)
    for i in range(0, 64, 32):
        g_big.step((x[i : i + 32], y[i : i + 32]))
        results = []
        with count_host_syncs() as syncs:
            for j in range(i, i + 32, 8):
                results.append(g_small.step((x[j : j + 8], y[j : j + 8])))
        assert results[:3] == [None, None, None] and results[3].trained
        assert syncs.count == 1
    for a, b in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


KINDS = {
    "StepLR": lambda o: S.StepLR(o, step_size=5, gamma=0.5),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=64),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=40),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_skipped_steps_do_not_advance_the_scheduler(kind):
    data = PoisonRows(regression_data(), indices=[5, 77], where="targets")
    result, _, opt = fit(dataset=data, epochs=2, scheduler=KINDS[kind])
    assert result.skipped_batches == 4, "two bad samples, two epochs"
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.02, momentum=0.9)
    sched = KINDS[kind](reference)
    for _ in range(result.optimizer_steps):
        reference.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-12)


def test_scheduler_follows_batches_when_configured():
    data = PoisonRows(regression_data(), indices=[5], where="targets")
    result, _, opt = fit(["guard.scheduler_follows=batch"], dataset=data, epochs=1, scheduler=KINDS["StepLR"])
    assert result.skipped_batches == 1 and result.optimizer_steps == 15
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 * 0.5 ** (16 // 5))


def test_backoff_survives_the_scheduler_through_fit():
    holder = {}
    data = PoisonRows(regression_data(), indices=[9], where="targets", value=math.inf)
    result, _, opt = fit(
        [
            "sanitize.targets=off",
            "recovery.actions.loss=scale_lr",
            "recovery.lr_factor=0.1",
            "recovery.escalate=[scale_lr]",
        ],
        dataset=data,
        epochs=2,
        scheduler=lambda o: holder.setdefault("s", KINDS["StepLR"](o)),
    )
    assert [a for _, a in anomalies(result)] == ["scale_lr", "scale_lr"] and result.lr_scale == pytest.approx(0.01)
    sched = holder["s"]
    schedule_alone = 0.02 * 0.5 ** (sched.last_epoch // 5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * schedule_alone, rel=1e-12)
    assert sched.get_last_lr()[0] == pytest.approx(schedule_alone), "the scheduler itself never sees the scale"


def test_resume_from_safetensors_is_bitwise(tmp_path):
    def run(max_steps=None, resume=None, epochs=3):
        torch.manual_seed(1)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = S.StepLR(opt, step_size=7, gamma=0.7)
        cfg = load_config(None, [*BASE, "snapshot.store=safetensors", f"snapshot.dir={tmp_path}", "snapshot.every=5"])
        trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=sched)
        data_loader = torch.utils.data.DataLoader(regression_data(), batch_size=16, shuffle=True)
        trainer.fit(data_loader, epochs=epochs, max_steps=max_steps, resume=resume)
        return model

    full = run()
    for f in tmp_path.iterdir():
        f.unlink()
    run(max_steps=23)  # stops mid-epoch 1; newest snapshot is at step 20
    resumed = run(resume=tmp_path)
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


class _RecordingPlateau(S.ReduceLROnPlateau):
    """ReduceLROnPlateau that records the metric of every ``step`` (class-level: not in its state)."""

    seen: list = []

    def step(self, metrics, epoch=None):
        _RecordingPlateau.seen.append(float(metrics))
        super().step(metrics)


def test_epoch_metric_of_a_run_resumed_mid_epoch_covers_the_whole_epoch(tmp_path):
    """An epoch-interval ReduceLROnPlateau gets the epoch's mean loss. A run stopped mid-epoch and
    resumed from its snapshot must hand it the mean over the WHOLE epoch (the steps before the
    snapshot included), as the uninterrupted run does, not over the resumed part only."""

    def run(max_steps=None, resume=None):
        torch.manual_seed(1)
        model = mlp(seed=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        sched = _RecordingPlateau(opt, patience=0)
        cfg = load_config(
            None,
            [
                *BASE,
                "snapshot.store=safetensors",
                f"snapshot.dir={tmp_path}",
                "snapshot.every=5",
                "guard.scheduler_interval=epoch",
            ],
        )
        trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss, scheduler=sched)
        _RecordingPlateau.seen = []
        trainer.fit(
            torch.utils.data.DataLoader(regression_data(), batch_size=32, shuffle=True),
            epochs=2,
            max_steps=max_steps,
            resume=resume,
        )
        return _RecordingPlateau.seen, trainer.guard

    full, _ = run()  # 8 batches an epoch: metrics of epochs 0 and 1
    for f in tmp_path.iterdir():
        f.unlink()
    run(max_steps=13)  # stops in epoch 1 (steps 9-16); the newest snapshot is at step 10
    resumed, guard = run(resume=tmp_path)
    assert len(full) == 2 and len(resumed) == 1, (full, resumed)
    assert resumed[0] == full[1], "the resumed epoch's metric must cover its steps before the snapshot too"
    assert guard.epoch_loss == full[1]


class TinyHF(torch.nn.Module):
    """A model with the Hugging Face convention: model(**batch) returns an object with .loss."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask, labels):
        h = (self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1)
        logits = self.head(h)
        return SimpleNamespace(loss=F.cross_entropy(logits, labels), logits=logits)


def test_dict_batches_with_loss_attribute_and_bad_float_feature_rows():
    torch.manual_seed(0)
    model = TinyHF()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    batches = []
    for i in range(8):
        mask = torch.ones(6, 5)
        if i == 3:
            mask[2, 1] = math.nan
        batches.append(
            {"input_ids": torch.randint(0, 20, (6, 5)), "attention_mask": mask, "labels": torch.randint(0, 3, (6,))}
        )
    result = SafeTrainer(model, opt, load_config(None, BASE)).fit(batches, epochs=2)
    assert anomalies(result) == [("input", "drop_rows")] * 2
    assert result.dropped_rows == 2 and finite_params(model)


def test_step_fn_for_any_batch():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    batches = [SimpleNamespace(x=x, y=y) for x, y in loader(regression_data())]
    trainer = SafeTrainer(model, opt, load_config(None, BASE), step_fn=lambda m, b: F.mse_loss(m(b.x), b.y))
    result = trainer.fit(batches)
    assert result.healthy_steps == 16


def test_replace_trains_on_replaced_values_and_says_so():
    data = PoisonRows(regression_data(), indices=[7], value=math.inf)
    result, model, _ = fit(["sanitize.inputs=replace", "sanitize.posinf=0.0"], dataset=data, epochs=1)
    assert anomalies(result) == [("input", "replace")]
    assert result.replaced_rows == 1 and result.skipped_batches == 0 and finite_params(model)


def test_raise_names_tensor_path_and_rows():
    data = PoisonRows(regression_data(), indices=[7])
    with pytest.raises(BatchError, match=r"batch\[0\]: rows \[\d+\] hold 1 NaN"):
        fit(["sanitize.inputs=raise"], dataset=data, epochs=1, seed=0)


def test_bad_batch_types_and_losses_are_clear_errors():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    with pytest.raises(BatchError, match="no loss_fn was given"):
        SafeTrainer(model, opt, load_config(None, BASE)).fit(loader(regression_data()))
    with pytest.raises(BatchError, match=r"the loss must be a scalar tensor; got \(16, 1\)"):
        SafeTrainer(model, opt, load_config(None, BASE), loss_fn=lambda o, t: F.mse_loss(o, t, reduction="none")).fit(
            loader(regression_data())
        )


def test_bf16_trains_without_scaler():
    result, model, _ = fit(["amp.dtype=bfloat16"], epochs=1)
    assert result.healthy_steps == result.steps == 16 and result.scaler_skips == 0 and finite_params(model)


def test_grad_norm_threshold_names_parameters_and_skip_after_restore_skips_data():
    def poison(model, opt):
        GradFault(model[0].weight, calls=[6], value=1e4)  # grad_norm is a finite outlier: no replay

    result, model, _ = fit(
        ["guard.grad_norm_threshold=50", "recovery.actions.grad_norm=restore", "recovery.skip_batches_after_restore=2"],
        setup=poison,
        epochs=1,
    )
    event = next(e for e in result.events if e.kind == "grad_norm")
    assert event.action == "restore"
    finding = event.detail["finding"]
    assert finding["above_threshold"] == ["0.weight"] and finding["norms"]["0.weight"] > 50
    skipped = [e for e in result.events if e.name == "restored" and e.action == "skip_batch"]
    assert len(skipped) == 2, "the two batches after the restore are skipped (PaLM recipe)"
    assert result.skipped_batches == 3 and result.restores == 1 and finite_params(model)


def test_lr_scale_climbs_back_after_healthy_steps():
    data = PoisonRows(regression_data(), indices=[9], where="targets", value=math.inf)
    result, _, opt = fit(
        ["sanitize.targets=off", "recovery.actions.loss=scale_lr", "recovery.lr_restore_after=5"],
        dataset=data,
        epochs=1,
    )
    changes = [e.detail["scale"] for e in result.events if e.name == "lr_changed"]
    assert changes == [0.5, 1.0]
    assert result.lr_scale == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(0.02)


def test_deferred_healthy_steps_are_in_the_history_every_reader_sees():
    """The guard applies healthy steps to the policy's history only when it is read. Whoever reads
    it (a snapshot, the ladder after a fault, a user) must see every healthy step: a snapshot
    taken mid-run restores the streak, and a fault after a long healthy run starts at rung 1."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(
        None,
        [
            *BASE,
            "snapshot.every=7",
            "recovery.reset_after=5",
            "sanitize.targets=off",
            "detect.replay.enabled=false",
            "recovery.actions.loss=skip_batch",
        ],
    )
    batches = list(loader(regression_data()))
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        _, history = decide(Anomaly("loss"), History(), Rules.of(cfg))
        guard.history = history  # one fault in the past: rung 1 climbed
        for batch in batches[:7]:
            assert guard.step(batch).action == ""
        saved = guard.store.latest().extra["history"]  # the snapshot taken at the 7th healthy step
        assert saved["healthy_streak"] == 7 and saved["consecutive"] == 0 and saved["recent"][-7:] == [0] * 7
        x, y = batches[7]
        result = guard.step((x, y * math.nan))
        assert result.action == "skip_batch", "after reset_after healthy steps the ladder starts again at rung 1"
        assert guard.history.consecutive == 1 and guard.history.healthy_streak == 0


# Regressions found in review -------------------------------------------------------------------


def test_finite_rows_whose_sum_overflows_are_not_bad_rows():
    """A finite batch whose float32 sum overflows trips the cheap flag; the exact check clears it."""
    x, y = regression_data(n=16).tensors
    x = x.clone()
    x[0, :2] = 3e38
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-40)  # keep the weights finite despite the huge row
    with Guard(model, opt, load_config(None, BASE), loss_fn=F.mse_loss) as guard:
        result = guard.step((x, y))
    assert not any(e.kind == "input" for e in result.events), "no input anomaly without a NaN/Inf value"


def test_a_snapshot_passed_over_is_never_restored_later():
    from safetrain.snapshot import MemoryStore

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(
        None,
        [
            *BASE,
            "snapshot.every=2",
            "snapshot.keep=2",
            "detect.replay.enabled=false",
            "recovery.actions.loss=restore",
            "sanitize.targets=off",
        ],
    )
    batches = list(loader(regression_data()))
    bad = {5, 8}  # steps 5 and 8 (1-based) have an infinite target: each comes right after a snapshot
    restored = []
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        assert isinstance(guard.store, MemoryStore)
        for i, (x, y) in enumerate(batches[:10], start=1):
            result = guard.step((x, torch.full_like(y, math.inf) if i in bad else y))
            restored += [e.detail["snapshot_step"] for e in result.events if e.name == "restored"]
    # Issue 23: the loss rises at step 2 (0.93, 0.98, 1.63): with one loss before it no invariant rule
    # tells a wobble from an LR far too high, so step 2 takes no snapshot (divergence.climbing) and
    # the restores land on step 0's, the last one vouched for (before: step 2's).
    assert restored == [0, 0], f"step 4's and step 7's snapshots were never vouched for: {restored}"


@pytest.mark.parametrize("action", ["replace", "drop_rows"])
def test_rows_of_a_rerun_step_are_counted_once(action):
    data = PoisonRows(regression_data(), indices=[7], value=math.inf)
    model = mlp()
    trainer = SafeTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.02),
        load_config(None, [*BASE, f"sanitize.inputs={action}"]),
        loss_fn=F.mse_loss,
    )
    result = trainer.fit(loader(data))
    assert result.healthy_steps == result.steps - 1
    assert len(trainer.guard.history.recent) == result.steps, "one policy entry per step"


def test_drop_rows_with_every_row_bad_is_journaled_as_a_skip():
    data = PoisonRows(regression_data(n=32), indices=range(16))
    model = mlp()
    trainer = SafeTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.02), load_config(None, BASE), loss_fn=F.mse_loss
    )
    result = trainer.fit(loader(data, shuffle=False))  # the first batch is all bad
    event = next(e for e in result.events if e.kind == "input")
    assert event.action == "skip_batch" and "every row is bad" in event.message
    assert result.dropped_rows == 0 and result.skipped_batches == 1
    assert trainer.guard.history.recent == (1, 0)


def test_rerun_does_not_step_a_batch_scheduler_twice():
    data = PoisonRows(regression_data(n=96), indices=[7])
    sched = lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=6)  # noqa: E731
    result, _, _ = fit(["guard.scheduler_follows=batch"], dataset=data, epochs=1, scheduler=sched)
    assert result.dropped_rows == 1 and result.steps == 6


def test_skip_after_restore_skips_whole_accumulation_groups_and_flush_takes_the_rest():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(
        None,
        [
            *BASE,
            "guard.accumulate_steps=2",
            "recovery.actions.loss=restore",
            "recovery.skip_batches_after_restore=1",
            "sanitize.targets=off",
            "detect.replay.enabled=false",
        ],
    )
    batches = list(loader(regression_data(n=80)))  # 5 micro-batches
    x, y = batches[1]
    batches[1] = (x, torch.full_like(y, math.inf))
    results = []
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        for batch in batches:
            results.append(guard.step(batch))
        results.append(guard.flush())
    done = [r for r in results if r is not None]
    assert [r.action for r in done] == ["restore", "skip_batch", ""], done
    assert guard.counters.steps == 3 and len(guard.history.recent) == 3
