"""Ctrl-C keeps Python's contract (issue 26, point 3): ``fit`` stops cleanly after the step on SIGINT
(a snapshot, the journal closed ``interrupted``) and raises an exception that is both a
``TrainingInterrupted`` and a ``KeyboardInterrupt``, so a script's own ``except KeyboardInterrupt:``
(the usual place to save a model on Ctrl-C) runs as it always did. SIGTERM keeps ``TrainingInterrupted``."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from safetrain import SafetrainError, TrainingInterrupted, TrainingKeyboardInterrupt
from safetrain.rundir import read_run
from safetrain.snapshot import list_snapshots
from tests.helpers.models import regression_data
from tests.helpers.signals import SignalAt, signal_trainer

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name == "nt", reason="POSIX signals"),
]

# A user's script: trains (paced, so that the signal lands mid-run) and handles the interruption
# the way its argument says, saving the model there as scripts do.
_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    import torch.nn.functional as F
    from safetrain import SafeTrainer, TrainingInterrupted, load_config

    run_dir, handler = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(500)]
    cfg = load_config(None, ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=1000",
                             f"log.dir={run_dir}"])
    trainer = SafeTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg, loss_fn=F.mse_loss)

    def paced():
        for i, batch in enumerate(data):
            if i == 5:
                print("training", flush=True)
            time.sleep(0.01)
            yield batch

    def save(why, exc):
        with open(os.path.join(run_dir, "saved.json"), "w") as f:
            json.dump({"by": why, "type": type(exc).__name__, "steps": exc.result.steps,
                       "weight": model.weight.tolist()}, f)

    if handler == "keyboard":
        try:
            trainer.fit(paced(), epochs=1)
        except KeyboardInterrupt as exc:
            save("except KeyboardInterrupt", exc)
            sys.exit(130)
    else:
        try:
            trainer.fit(paced(), epochs=1)
        except TrainingInterrupted as exc:
            save("except TrainingInterrupted", exc)
            sys.exit(143)
    sys.exit(0)
    """
)


@pytest.mark.parametrize(
    "handler, code, by",
    [("keyboard", 130, "except KeyboardInterrupt"), ("interrupted", 143, "except TrainingInterrupted")],
)
def test_a_real_ctrl_c_runs_the_scripts_own_handler_after_a_clean_stop(tmp_path, handler, code, by):
    """Fails before: the exception was a TrainingInterrupted only, so the script's
    ``except KeyboardInterrupt:`` never ran and the process ended on a traceback (status 1).
    Pattern: the Lightning/HF-style ``try: train() except KeyboardInterrupt: save()`` scripts."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    child = subprocess.Popen(
        [sys.executable, "-c", _SCRIPT, str(tmp_path), handler],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout.readline().strip() == "training", child.stderr.read()[-3000:]
        os.kill(child.pid, signal.SIGINT)
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == code, f"{out[-2000:]}\n{err[-3000:]}"
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved["by"] == by and saved["type"] == "TrainingKeyboardInterrupt"
    run = read_run(tmp_path)
    ended = [e for e in run.events if e["event"] == "run_ended"]
    assert [e["action"] for e in ended] == ["interrupted"], ended
    stopped = ended[0]["step"]
    assert saved["steps"] == stopped and 5 <= stopped < 500, "stopped mid-run, the result says where"
    assert run.summary is not None and run.summary["ended"] == "interrupted"
    assert ended[0]["detail"]["error"] == "TrainingKeyboardInterrupt"
    assert any(f"snapshot-{stopped:010d}" in str(p) for p in list_snapshots(tmp_path / "snapshots"))


@pytest.fixture(autouse=True)
def _no_default_sigterm():
    """A recording SIGTERM handler: were fit's handler missing, SIGTERM would not kill the tests."""
    old = signal.signal(signal.SIGTERM, lambda s, f: None)
    yield
    signal.signal(signal.SIGTERM, old)


def _trainer(tmp_path, *overrides):
    return signal_trainer(tmp_path, *overrides)[1]  # (the model is not needed here)


def test_sigint_raises_a_keyboard_interrupt_that_every_handler_kind_catches(tmp_path):
    loader = DataLoader(regression_data(64), batch_size=8)
    with pytest.raises(KeyboardInterrupt) as info:
        _trainer(tmp_path).fit(SignalAt(loader, 3, signal.SIGINT), epochs=2)
    exc = info.value
    assert type(exc) is TrainingKeyboardInterrupt and exc.signal == signal.SIGINT
    assert isinstance(exc, (TrainingInterrupted, SafetrainError, Exception))  # handlers as before keep working
    assert exc.result.steps == 4 and exc.result.ended == "interrupted"


def test_a_second_ctrl_c_is_a_keyboard_interrupt_too(tmp_path):
    loader = DataLoader(regression_data(64), batch_size=8)
    with pytest.raises(TrainingKeyboardInterrupt, match="again"):
        _trainer(tmp_path).fit(SignalAt(loader, 2, signal.SIGINT, times=2), epochs=1)
    assert read_run(tmp_path).events[-1]["action"] == "interrupted"


def test_sigterm_keeps_its_exception_and_on_signal_return_keeps_returning(tmp_path):
    loader = DataLoader(regression_data(64), batch_size=8)
    with pytest.raises(TrainingInterrupted) as info:
        _trainer(tmp_path / "a").fit(SignalAt(loader, 2, signal.SIGTERM), epochs=1)
    assert type(info.value) is TrainingInterrupted and not isinstance(info.value, KeyboardInterrupt)
    # (fit pulls the first three batches before its first step, to measure the start: the signal at
    # the pull of batch 3 comes during step 4, which it lets finish)
    result = _trainer(tmp_path / "b", "log.on_signal=return").fit(SignalAt(loader, 3, signal.SIGINT), epochs=1)
    assert result.ended == "interrupted" and result.steps == 4


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_cli_says_interrupted_with_the_signals_exit_code(monkeypatch, capsys, sig, code):
    """Before, a SIGINT the demo's fit caught ended ``error: ...`` with exit code 2 (a usage error's)."""
    from safetrain import cli
    from safetrain.ending import interruption

    def stopped(args):
        raise interruption(f"{signal.Signals(sig).name}: stopped after step 3", sig)

    parser = argparse.ArgumentParser()
    parser.set_defaults(func=stopped, command="demo")
    monkeypatch.setattr(cli, "_parser", lambda: parser)
    assert cli.main([]) == code
    assert "interrupted: " in capsys.readouterr().err
