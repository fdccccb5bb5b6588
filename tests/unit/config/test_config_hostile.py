"""Configuration under hostile input: alias bombs, wrong container types, non-boolean bools (issue 16)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from safetrain import ConfigError, TrainConfig, as_config, load_config
from safetrain.cli import main
from safetrain.config import iter_fields

ROOT = Path(__file__).resolve().parents[3]


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """A few hundred bytes of YAML whose `detect.include` stands for width**levels strings."""
    items = ["&a0 [" + ", ".join(["x"] * width) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "detect:\n  include: [" + ", ".join(items) + "]\n"


def test_yaml_alias_bomb_in_a_list_key_is_refused_quickly_in_one_line(tmp_path):
    """Issue 16: a 410-byte alias bomb in `detect.include` ran for hours and printed 350k characters.

    Fails before: the load never finishes (killed by the timeout).
    """
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb())
    assert path.stat().st_size < 600
    code = "import sys; from safetrain.cli import main; sys.exit(main(['check-config', sys.argv[1]]))"
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert proc.stderr.count("\n") == 1 and len(proc.stderr) < 300, proc.stderr[:500]
    assert f"{path}: detect.include: expands to more than" in proc.stderr


def test_alias_bomb_passed_as_a_dict_is_bounded_too():
    shared: list = ["x"] * 10
    for _ in range(8):
        shared = [shared] * 10
    with pytest.raises(ConfigError, match=r"^detect\.include: expands to more than \d+ values"):
        as_config({"detect": {"include": shared}})


def test_self_referential_alias_is_refused(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("detect:\n  include: &a [x, *a]\n")
    with pytest.raises(ConfigError, match=r"detect\.include: a YAML alias refers to itself"):
        load_config(path)


def test_list_key_items_are_checked_not_converted(tmp_path):
    """Fails before: `[1, 2]` became ['1', '2'] and nested lists went into OmegaConf."""
    with pytest.raises(ConfigError, match=r"^override: detect\.include: item 1: got 1; expected a string"):
        load_config(None, ["detect.include=[a,1]"])
    path = tmp_path / "c.yaml"
    path.write_text("# x\ndetect:\n  nan_only:\n    - attn\n    - [a, b]\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: detect\.nan_only: item 1: got \['a', 'b'\]; expected a str"):
        load_config(path)


WRONG_TYPES = [
    # (override, message): one line naming the key, the value and what is allowed
    ("detect.exclude={a:1}", r"^override: detect\.exclude: got \{'a:1': None\}; expected a list of strings$"),
    ("recovery.escalate={a:1}", r"^override: recovery\.escalate: got \{'a:1': None\}; expected a list of strings$"),
    ("recovery.actions=[a]", r"^override: recovery\.actions: got \['a'\]; expected a mapping of strings$"),
    ("detect.replay.enabled=2", r"^override: detect\.replay\.enabled: got 2; expected true or false$"),
    ("detect.replay.enabled=0", r"^override: detect\.replay\.enabled: got 0; expected true or false$"),
    ("log.progress='true'", r"^override: log\.progress: got 'true'; expected true or false$"),
    ("log.dir=[a]", r"^override: log\.dir: got \['a'\]; expected a string or null$"),
    ("guard.clip_grad_norm={a:1}", r"^override: guard\.clip_grad_norm: got \{'a:1': None\}; expected a number or null"),
]


@pytest.mark.parametrize("override,message", WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_wrong_types_are_one_line_errors_and_check_config_exits_2(override, message, capsys):
    """Fails before: a mapping for a list key raised TypeError from OmegaConf; 2 and 0 were taken as booleans."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    assert main(["check-config", str(ROOT / "configs" / "default.yaml"), override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("safetrain check-config: error: override: "), err


def bool_keys() -> list:
    cfg = TrainConfig()
    keys = []
    for dotted, f, value in iter_fields(cfg):
        if dataclasses.is_dataclass(value):
            continue
        owner = cfg
        for part in dotted.split(".")[:-1]:
            owner = getattr(owner, part)
        if typing.get_type_hints(type(owner))[f.name] is bool:
            keys.append(dotted)
    return keys


def test_every_bool_key_takes_only_booleans():
    keys = bool_keys()
    assert len(keys) >= 4
    for key in keys:
        for bad in ("2", "1", "'yes please'", "1.0"):
            with pytest.raises(ConfigError, match=rf"^override: {key}: got .*; expected true or false$"):
                load_config(None, [f"{key}={bad}"])
        assert load_config(None, [f"{key}=false"]) is not None


def test_a_hand_built_config_with_an_int_for_a_bool_is_refused():
    from safetrain.config import LogConfig

    with pytest.raises(ConfigError, match=r"log\.progress: got 2; expected true or false"):
        as_config(TrainConfig(log=LogConfig(progress=2)))  # type: ignore[arg-type]


def test_error_values_are_cut_short():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["detect.exclude={" + ",".join(f"k{i}:1" for i in range(200)) + "}"])
    assert len(str(info.value)) < 250


def nested_interpolations(repeat: int, length: int) -> str:
    """YAML whose `snapshot.dir` repeats `log.dir` and whose `detect.include` repeats that again:
    `repeat**2 * length` characters once resolved (the issue's 230 KB file: past 2 minutes and 1 GB)."""
    return (
        f"log:\n  dir: {'x' * length}\n"
        f"snapshot:\n  dir: '{'${log.dir}' * repeat}'\n"
        f"detect:\n  include: ['{'${snapshot.dir}' * repeat}']\n"
    )


def test_nested_interpolations_are_refused_before_they_are_resolved(tmp_path):
    """Issue 36: string interpolations that repeat one another resolve without bound.

    Fails before: this 2 KB file loads, its `detect.include[0]` 10,000,000 characters long (the
    issue's 230 KB one never finished); now a ConfigError naming the key, in milliseconds.
    """
    path = tmp_path / "nest.yaml"
    path.write_text(nested_interpolations(100, 1000))
    start = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert message.startswith(f"{path}:6: detect.include[0]: cannot resolve '${{snapshot.dir}}"), message
    assert "would resolve to over 1048576 characters" in message and len(message) < 400


def test_nested_interpolations_from_overrides_and_a_long_chain_are_refused_too():
    overrides = [
        "log.dir=" + "y" * 2000,
        "snapshot.dir=" + "${log.dir}" * 200,
        "detect.include=['" + "${snapshot.dir}" * 50 + "']",
    ]
    with pytest.raises(ConfigError, match=r"^override: detect\.include\[0\]: cannot resolve .*would resolve to over"):
        load_config(None, overrides)
    chain = ["a"] + [f"${{detect.include[{i}]}}" for i in range(3000)]  # each item the one before
    with pytest.raises(ConfigError, match=r"detect\.include\[\d+\]: cannot resolve"):
        as_config({"detect": {"include": chain}})


def test_ordinary_interpolations_still_resolve(monkeypatch):
    monkeypatch.setenv("SAFETRAIN_TEST_RUNS", "/scratch/runs")
    cfg = load_config(None, ["log.dir=${oc.env:SAFETRAIN_TEST_RUNS}/a", "snapshot.dir=${log.dir}/snaps"])
    assert (cfg.log.dir, cfg.snapshot.dir) == ("/scratch/runs/a", "/scratch/runs/a/snaps")
    cfg = load_config(None, ["detect.include=[" + ",".join(["'${log.dir}'"] * 50) + "]", "log.dir=" + "z" * 1000])
    assert cfg.detect.include == ("z" * 1000,) * 50


def test_nested_interpolations_in_a_dictconfig_are_refused_too():
    """A DictConfig handed to as_config (OmegaConf.load of someone's file) is resolved by OmegaConf
    itself: the same bound first. Fails before: resolved to 10,000,000 characters."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "log": {"dir": "x" * 1000},
            "snapshot": {"dir": "${log.dir}" * 100},
            "detect": {"include": ["${snapshot.dir}" * 100]},
        }
    )
    with pytest.raises(
        ConfigError,
        match=r"^DictConfig: detect\.include\[0\]: cannot resolve '\$\{snapshot\.dir\}.*would resolve to over",
    ):
        as_config(cfg)
