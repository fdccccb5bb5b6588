"""Adaptive (ZClip) clipping and the adaptive grad_norm threshold, through the guard's step.

A gradient-norm outlier that is not a fault (a hard batch, a loss-landscape cliff) is the event
that ZClip (arXiv:2504.02507) clips instead of letting it through or skipping the step; PaLM
(arXiv:2204.02311, 5.1) skipped data and rewound some 20 times for such spikes. Each test injects
an outlier with :class:`~safetrain.testing.GradFault` (a finite factor on one gradient).
"""

from __future__ import annotations

import csv
import json
import math
from typing import Any, List

import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.guard import Guard
from safetrain.stats.gradclip import NormStats
from safetrain.testing import GradFault, count_host_syncs
from tests.helpers.models import loader, mlp, regression_data

BASE = ["log.progress=false", "guard.spike.min_history=8", "detect.check_weights_every=0"]
ADAPTIVE = ["guard.clip.mode=adaptive", "guard.clip.warmup_steps=5"]


def batches(n: int, seed: int = 0) -> List[Any]:
    out: List[Any] = []
    while len(out) < n:
        out += list(loader(regression_data(seed=seed + len(out)), batch_size=16, seed=seed))
    return out[:n]


def guard_of(overrides: List[str], lr: float = 0.02, model: Any = None) -> Guard:
    model = model if model is not None else mlp()
    cfg = load_config(None, [*BASE, *overrides])
    return Guard(model, torch.optim.SGD(model.parameters(), lr=lr), cfg, loss_fn=F.mse_loss)


def reference(results: List[Any], cfg_warmup: int = 5) -> NormStats:
    """The statistics by hand: ZClip's rule over the trained steps' norms as read."""
    ref = NormStats(warmup_steps=cfg_warmup)
    for r in results:
        if r.trained:
            limit = ref.limit(r.grad_norm)
            ref.update(r.grad_norm, limit)
    return ref


def test_an_injected_outlier_is_clipped_not_skipped_and_the_gradients_are_at_the_clipped_norm():
    model = mlp()
    guard = guard_of(ADAPTIVE, model=model)
    GradFault(model[2].weight, calls=[12], value=40.0)
    clipped = []
    with guard:
        for i, (x, y) in enumerate(batches(16)):
            guard.begin_batch((x, y))
            loss = F.mse_loss(model(x), y)
            guard.record_loss(loss)
            loss.backward()
            decided = guard.decide()
            if i == 11:  # the outlier: trained, its gradients already clipped by decide()
                total = math.hypot(*(float(p.grad.norm()) for p in model.parameters()))
                clipped = [decided, total]
            if decided.trained:
                guard.optimizer.step()
            guard.finish_step()
    decided, total = clipped
    assert decided.trained and decided.action == "", "an outlier the statistics explain is clipped, not skipped"
    assert decided.grad_norm > 10 * decided.clipped_to, (decided.grad_norm, decided.clipped_to)
    assert math.isclose(total, decided.clipped_to, rel_tol=1e-4), "the update uses the clipped gradients"
    assert [e.name for e in decided.events] == ["clipped"] and decided.events[0].detail["zscore"] > 2.5


def test_fit_journals_one_event_per_episode_and_counts_clipped_steps(tmp_path):
    torch.manual_seed(0)
    model = mlp()
    cfg = load_config(None, [*BASE, *ADAPTIVE, f"log.dir={tmp_path}"])
    GradFault(model[2].weight, calls=[20, 21, 22, 40], value=30.0)  # two episodes: steps 20-22 and 40
    trainer = SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.02), cfg, loss_fn=F.mse_loss)
    result = trainer.fit(loader(regression_data(), batch_size=8), epochs=2)
    assert result.skipped_batches == 0 and result.restores == 0, "clipped steps are healthy steps"
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    flags = [math.isfinite(float(r["clipped_to"])) for r in rows]
    assert all(flags[s - 1] for s in (20, 21, 22, 40)), "the outlier steps were clipped"
    episodes = sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))
    journal = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    events = [e for e in journal if e.get("event") == "clipped"]
    assert len(events) == episodes >= 2, "one journal event per episode, not per step"
    assert 20 in [e["step"] for e in events] and 21 not in [e["step"] for e in events]
    assert result.clipped_steps == sum(flags) >= 4, "every clipped step is counted"
    assert journal[-1]["clipped_steps"] == result.clipped_steps, "the summary line carries the count"
    assert not [e for e in journal if e.get("event") == "anomaly"], "no anomaly: clipping prevented them"


def test_the_statistics_match_a_hand_computation_and_fp16_skips_do_not_feed_them():
    overrides = [*ADAPTIVE, "amp.dtype=float16", "amp.init_scale=1048576", "recovery.max_retries=30"]
    guard = guard_of([*overrides, "amp.max_overflows=30"], lr=0.01)
    with guard:
        results = [guard.step(b) for b in batches(30)]
    assert guard.counts.scaler_skips >= 3, "the first steps overflowed (the scale falls from 1e12)"
    assert [r.trained for r in results].count(False) == guard.counts.scaler_skips
    ref = reference(results)
    assert guard.norm_stats.state_dict() == ref.state_dict(), "trained steps only, by ZClip's rule"
    assert ref.mean is not None and ref.mean < 100, "unscaled norms (scaled ones would be ~1e4 or more)"


def test_the_statistics_round_trip_bitwise_through_a_snapshot_and_resume(tmp_path):
    opts = [*ADAPTIVE, "snapshot.store=safetensors", f"snapshot.dir={tmp_path}", "snapshot.every=10"]
    data = batches(30)
    with guard_of(opts) as a:
        for b in data[:20]:
            a.step(b)
        saved = json.loads(json.dumps(a.state_dict()["grad_norm"]))  # the step-20 snapshot's
        first = [a.step(b) for b in data[20:]]
        final = a.state_dict()["grad_norm"]
    with guard_of([*opts, "snapshot.overwrite=true"]) as b_guard:
        b_guard.resume(tmp_path / "snapshot-0000000020.safetensors")
        assert b_guard.state_dict()["grad_norm"] == saved, "bitwise: the floats come back exact"
        second = [b_guard.step(b) for b in data[20:]]
        assert b_guard.state_dict()["grad_norm"] == final, "the resumed run goes on exactly as the first"
    assert [(r.grad_norm, repr(r.clipped_to)) for r in first] == [(r.grad_norm, repr(r.clipped_to)) for r in second]


def test_a_clip_episode_open_at_a_snapshot_goes_on_after_resume_without_a_second_event(tmp_path):
    opts = [*ADAPTIVE, "snapshot.store=safetensors", f"snapshot.dir={tmp_path}", "snapshot.every=10"]
    data = batches(24)
    model = mlp()
    GradFault(model[2].weight, calls=[19, 20, 21, 22], value=30.0)  # one episode, steps 19-22, across the snapshot
    with guard_of(opts, model=model) as a:
        first = [a.step(b) for b in data]
    assert all(math.isfinite(r.clipped_to) for r in first[18:22]), "the outliers were clipped"
    assert [r.step for r in first if any(e.name == "clipped" for e in r.events)] == [19], "one event: the episode's"
    model = mlp()
    GradFault(model[2].weight, calls=[1, 2], value=30.0)  # steps 21 and 22 again, after the resume
    with guard_of([*opts, "snapshot.overwrite=true"], model=model) as b_guard:
        b_guard.resume(tmp_path / "snapshot-0000000020.safetensors")
        assert b_guard.state_dict()["clip_episode"] is True, "the snapshot carries the open episode"
        second = [b_guard.step(b) for b in data[20:]]
    assert [r.clipped_to for r in second[:2]] == [r.clipped_to for r in first[20:22]], "clipped as the first run did"
    assert not [e for r in second for e in r.events if e.name == "clipped"], "the same episode: not journaled again"


def test_a_restore_puts_the_statistics_back_with_the_weights():
    model = mlp()
    overrides = [*ADAPTIVE, "snapshot.every=10", "recovery.actions.gradient=restore", "detect.replay.enabled=false"]
    guard = guard_of(overrides, model=model)
    at_snapshot = {}
    guard.bus.subscribe(
        lambda e: at_snapshot.update({e.step: guard.norm_stats.state_dict()}) if e.name == "snapshot" else None
    )
    GradFault(model[2].weight, calls=[15], value=math.nan)
    with guard:
        results = [guard.step(b) for b in batches(15)]
    assert results[-1].action == "restore" and results[-1].restored
    assert guard.norm_stats.state_dict() == at_snapshot[10], "the statistics are the snapshot's again"
    assert guard.norm_stats.state_dict() != reference(results[:-1]).state_dict(), "(steps 11-14 had moved them)"


def test_adaptive_clipping_and_threshold_add_no_host_sync():
    guard = guard_of(
        [*ADAPTIVE, "guard.clip.warmup_steps=2", "guard.grad_norm_threshold=adaptive", "snapshot.every=1000"]
    )
    model = guard.model
    GradFault(model[2].weight, calls=[6], value=3.0)  # a clipped step counts too
    data = batches(10)
    with guard:
        guard.step(data[0])  # (the first step's forced snapshot is not a healthy step's cost)
        for i, b in enumerate(data[1:], start=2):
            with count_host_syncs() as syncs:
                r = guard.step(b)
            assert r.action == "" and syncs.count == 1, f"step {i}: {syncs}"
    assert guard.counts.clipped_steps >= 1


def test_the_adaptive_threshold_skips_a_far_outlier_that_clipping_alone_would_hide():
    model = mlp()
    guard = guard_of([*ADAPTIVE, "guard.grad_norm_threshold=adaptive"], model=model)
    GradFault(model[2].weight, calls=[12], value=1e4)
    with guard:
        results = [guard.step(b) for b in batches(14)]
    r = results[11]
    assert not r.trained and r.action == "skip_batch"
    (event,) = [e for e in r.events if e.name == "anomaly"]
    assert event.kind == "grad_norm" and event.detail["finding"]["threshold"] < r.grad_norm / 100
    assert all(x.trained for i, x in enumerate(results) if i != 11), "no false alarm on the other steps"
