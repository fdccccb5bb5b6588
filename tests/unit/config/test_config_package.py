"""The config package: no torch, and the schema and validator speak the vocabulary of safetrain.kinds."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from safetrain import ConfigError, load_config
from safetrain.config import RecoveryConfig, SanitizeAction, TrainConfig
from safetrain.kinds import ALLOWED_FIRST, DEFAULT_ESCALATE, DEFAULT_FIRST, ESCALATION, SANITIZE_ACTIONS, Action, Kind

PACKAGE = Path(__file__).resolve().parents[3] / "safetrain"

# Imports the config package with torch blocked and without running safetrain/__init__.py (which
# may import torch-using modules): the parent package is an empty stub whose path is the real one.
NO_TORCH = f"""
import importlib, sys, types
sys.modules["torch"] = None
parent = types.ModuleType("safetrain")
parent.__path__ = [{str(PACKAGE)!r}]
sys.modules["safetrain"] = parent
for name in ("safetrain.kinds", "safetrain.config", "safetrain.config.schema", "safetrain.config.validate",
             "safetrain.config.yamlfile", "safetrain.config.overrides", "safetrain.config.interpolate",
             "safetrain.config.loader"):
    importlib.import_module(name)
cfg = sys.modules["safetrain.config"].load_config(None, ["recovery.max_retries=3"])
assert cfg.recovery.max_retries == 3
assert sys.modules["torch"] is None
loaded = sorted(m for m in sys.modules if m.startswith("safetrain."))
print(" ".join(loaded))
"""


def test_config_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert loaded <= {
        "safetrain.errors",
        "safetrain.kinds",
        "safetrain.config",
        "safetrain.config.schema",
        "safetrain.config.validate",
        "safetrain.config.yamlfile",
        "safetrain.config.presets",
        "safetrain.config.overrides",
        "safetrain.config.interpolate",
        "safetrain.config.loader",
    }, loaded


def test_sanitize_choices_are_the_vocabulary():
    assert typing.get_args(SanitizeAction) == SANITIZE_ACTIONS
    hints = typing.get_type_hints(TrainConfig().sanitize.__class__)
    assert hints["inputs"] == hints["targets"] == SanitizeAction


def test_recovery_defaults_are_the_vocabulary_as_plain_strings():
    rec = RecoveryConfig()
    assert rec.actions == {k.value: a.value for k, a in DEFAULT_FIRST.items()}
    assert rec.escalate == [a.value for a in DEFAULT_ESCALATE]
    loaded = load_config().recovery
    for value in [*loaded.actions, *loaded.actions.values(), *loaded.escalate]:
        assert type(value) is str, f"{value!r} should be a plain string as read from YAML"
    assert loaded.actions["loss"] == Action.SKIP_BATCH and Kind.GRADIENT in loaded.actions


@pytest.mark.parametrize("kind", sorted(ALLOWED_FIRST))
def test_every_allowed_first_action_loads_and_no_other(kind):
    for action in Action:
        overrides = [f"recovery.actions.{kind.value}={action.value}"]
        if action in ALLOWED_FIRST[kind]:
            assert load_config(None, overrides).recovery.actions[kind.value] == action.value
        else:
            with pytest.raises(ConfigError, match=rf"recovery\.actions\.{kind.value}: got '{action.value}'"):
                load_config(None, overrides)


def test_every_escalation_action_loads_and_no_other():
    for action in Action:
        overrides = [f"recovery.escalate=[{action.value}]"]
        if action in ESCALATION:
            assert load_config(None, overrides).recovery.escalate == (action.value,)
        else:
            with pytest.raises(ConfigError, match=rf"recovery\.escalate: item 0: got '{action.value}'"):
                load_config(None, overrides)
