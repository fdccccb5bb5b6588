"""The Lightning and the Hugging Face callbacks agree (issue #35): one name (``SafeTrainingCallback``),
one abort behaviour (``on_abort``, raising :class:`~safetrain.TrainingAborted` out of the framework's
``fit``/``train`` by default), one set of metric keys (:func:`safetrain.metrics.step_metrics`).
Each scenario runs the same fault through the real ``lightning.pytorch.Trainer`` and the real
``transformers.Trainer`` (tiny models built from configs, no downloads) and checks both the same way.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Set

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainerCallback  # noqa: E402

from safetrain import TrainingAborted, deprecation  # noqa: E402
from safetrain.integrations import lightning as pl_cb  # noqa: E402
from safetrain.integrations.huggingface import SafeTrainingCallback as HFCallback  # noqa: E402
from safetrain.integrations.lightning import SafeTrainingCallback as PLCallback  # noqa: E402
from safetrain.metrics import COUNTERS, metric_keys  # noqa: E402
from safetrain.testing import OutputFault  # noqa: E402
from tests.helpers.huggingface import Tokens, args, gpt2  # noqa: E402
from tests.helpers.lightning import CFG, Collect, Net, loader, trainer  # noqa: E402

QUIET = {"detect": {"check_weights_every": 0, "replay": {"enabled": False}}, "log": {"level": "WARNING"}}
NAN_ONCE = [4]  # step 4's forward (no replay): one skipped step
FOREVER = range(4, 10**9)  # from step 4 on: retries, restores, then the abort


def _journal(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


class _HFLogs(TrainerCallback):
    """The ``safetrain/`` keys of the Trainer's logs (what its reporters and ``log_history`` get)."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs:
            self.rows.append({k: v for k, v in logs.items() if k.startswith("safetrain/")})


def run_lightning(tmp: Path, calls: Any, cfg: Dict[str, Any], **cb_kw: Any) -> Dict[str, Any]:
    model = Net()
    OutputFault(model.conv, calls=calls)
    cb, log = PLCallback({**CFG, **QUIET, **cfg}, **cb_kw), Collect()
    t = trainer(cb, tmp, max_steps=10, logger=log, log_every_n_steps=1)
    out: Dict[str, Any] = {"cb": cb, "model": model, "error": None}
    try:
        t.fit(model, loader())
    except TrainingAborted as exc:
        out["error"] = exc
    rows = [{k: v for k, v in m.items() if k.startswith("safetrain/")} for _, m in log.rows]
    out["rows"] = [row for row in rows if row]  # (not the module's own self.log rows)
    out["journal"] = _journal(tmp / "safetrain" / "events.jsonl")
    return out


def run_huggingface(tmp: Path, calls: Any, cfg: Dict[str, Any], **cb_kw: Any) -> Dict[str, Any]:
    model = gpt2()
    OutputFault(model.transformer.h[1].mlp, calls=calls)
    cb, logs = HFCallback({**QUIET, **cfg}, **cb_kw), _HFLogs()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # one parameter group, as the Lightning module's
    t = Trainer(
        model=model,
        args=args(tmp, 10, logging_steps=1),
        train_dataset=Tokens(),
        callbacks=[cb, logs],
        optimizers=(opt, None),
    )
    out: Dict[str, Any] = {"cb": cb, "model": model, "error": None}
    try:
        t.train()
    except TrainingAborted as exc:
        out["error"] = exc
    out["rows"] = [row for row in logs.rows if row]
    out["journal"] = _journal(tmp / "events.jsonl")
    return out


RUNS: Dict[str, Callable[..., Dict[str, Any]]] = {"lightning": run_lightning, "huggingface": run_huggingface}


def test_both_callbacks_log_the_same_keys_from_the_one_function(tmp_path):
    """Before: Lightning logged ``safetrain/lr_scale`` and 9 counters, Hugging Face an unprefixed
    ``lr_scale`` and 3 counters. Now both log every key of ``metric_keys()`` (clipping on, so that
    ``safetrain/clipped_to`` is there too), and the counters they end with say the same thing."""
    cfg = {"guard": {"clip_grad_norm": 1e-3}}
    runs = {name: run(tmp_path / name, NAN_ONCE, cfg) for name, run in RUNS.items()}
    keys: Dict[str, Set[str]] = {name: set().union(*r["rows"]) for name, r in runs.items()}
    assert keys["lightning"] == keys["huggingface"] == set(metric_keys()), keys
    assert {f"safetrain/{c}" for c in COUNTERS} <= keys["lightning"] and len(COUNTERS) >= 11
    for name, r in runs.items():
        last = r["rows"][-1]
        assert last["safetrain/skipped_batches"] == 1.0 and last["safetrain/restores"] == 0.0, (name, last)
        assert r["error"] is None and r["cb"].result.ended == "done", name
        skipped = [row for row in r["rows"] if row.get("safetrain/trained") == 0.0]
        assert skipped and "safetrain/loss" not in skipped[0], (name, "a skipped step's NaN loss is left out")


def test_an_abort_raises_out_of_fit_and_train_the_same_way(tmp_path):
    """Before: Lightning raised out of ``trainer.fit``, while ``trainer.train()`` returned as if it
    had finished (``raise_if_aborted()`` needed). Now both raise ``TrainingAborted`` by default,
    with the same message (the cause and the setting that bounds it), the exception kept on
    ``cb.aborted`` with its ``FitResult``, the journal's last word ``aborted`` (never ``done``),
    the model finite at the last good state."""
    messages = {}
    for name, run in RUNS.items():
        r = run(tmp_path / name, FOREVER, {"recovery": {"max_retries": 2}})
        exc, cb = r["error"], r["cb"]
        assert type(exc) is TrainingAborted and exc is cb.aborted, (name, exc)
        assert exc.result is cb.result and cb.result.ended == "aborted" and cb.result.aborted, name
        messages[name] = str(exc)
        ended = [e for e in r["journal"] if e.get("event") == "run_ended"]
        last = [e for e in r["journal"] if e.get("event") != "summary"][-1]
        assert [e["action"] for e in ended] == ["aborted"] and last == ended[0], name
        assert _finite(r["model"]), name
        with pytest.raises(TrainingAborted):
            cb.raise_if_aborted()
    assert messages["lightning"] == messages["huggingface"], messages
    assert "forward" in messages["lightning"] and "recovery.max_retries" in messages["lightning"], messages


@pytest.mark.parametrize("framework", sorted(RUNS))
def test_on_abort_stop_returns_on_both_and_raise_if_aborted_raises(tmp_path, framework):
    r = RUNS[framework](tmp_path, FOREVER, {"recovery": {"max_retries": 2}}, on_abort="stop")
    cb = r["cb"]
    assert r["error"] is None and isinstance(cb.aborted, TrainingAborted) and cb.result.ended == "aborted"
    with pytest.raises(TrainingAborted) as raised:
        cb.raise_if_aborted()
    assert raised.value is cb.aborted
    assert [e["action"] for e in r["journal"] if e.get("event") == "run_ended"] == ["aborted"]


@pytest.mark.parametrize("cls", [PLCallback, HFCallback])
def test_a_wrong_on_abort_is_refused_naming_the_choices(cls):
    with pytest.raises(ValueError, match="expected 'raise' or 'stop'"):
        cls(on_abort="continue")


def test_the_old_lightning_name_still_works_and_warns_once(tmp_path, monkeypatch):
    """``SafeTraining`` (the Lightning callback's name before) is the same class, warning once."""
    monkeypatch.setattr(deprecation, "_warned", set())
    with pytest.warns(DeprecationWarning, match="SafeTrainingCallback"):
        from safetrain.integrations.lightning import SafeTraining
    assert SafeTraining is PLCallback
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pl_cb.SafeTraining is PLCallback  # once: no second warning
    cb = SafeTraining(CFG)
    trainer(cb, tmp_path, max_steps=3).fit(Net(), loader())
    assert cb.result.ended == "done" and cb.result.steps == 3
    with pytest.raises(AttributeError, match="no attribute 'SafeTrainingCallbak'"):
        pl_cb.SafeTrainingCallbak  # noqa: B018 - a typo still fails


def test_the_old_log_grad_norm_argument_still_works_and_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(deprecation, "_warned", set())
    with pytest.warns(DeprecationWarning, match="log_metrics"):
        cb = PLCallback(CFG, log_grad_norm=False)
    log = Collect()
    trainer(cb, tmp_path, max_steps=3, logger=log, log_every_n_steps=1).fit(Net(), loader())
    assert cb.log_metrics is False and not any(k.startswith("safetrain/") for _, m in log.rows for k in m)


def test_a_checkpoint_saved_under_the_old_name_resumes_the_guards_state(tmp_path):
    """Lightning keys a callback's state by its class name: a checkpoint written before the rename
    holds it under ``SafeTraining``; the renamed callback still takes it."""
    model = Net()
    OutputFault(model.conv, calls=NAN_ONCE)
    t = trainer(PLCallback({**CFG, **QUIET}), tmp_path, max_steps=6)
    t.fit(model, loader())
    t.save_checkpoint(tmp_path / "new.ckpt")
    ckpt = torch.load(tmp_path / "new.ckpt", weights_only=False)
    ckpt["callbacks"] = {"SafeTraining": ckpt["callbacks"].pop("SafeTrainingCallback")}
    torch.save(ckpt, tmp_path / "old.ckpt")
    again = PLCallback({**CFG, **QUIET})
    trainer(again, tmp_path / "2", max_steps=8).fit(Net(), loader(), ckpt_path=tmp_path / "old.ckpt")
    c = again.guard.counters
    assert (c.steps, c.skipped_batches) == (8, 1), "the old checkpoint's counters carried on"
