"""Configuration: loading, overrides, presets, and every error path with its message."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from safetrain import ConfigError, TrainConfig, as_config, load_config
from safetrain.config import iter_fields, to_dict

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_when_no_file():
    cfg = load_config()
    assert cfg == load_config(None, [])
    assert cfg.detect.mode == "eager"
    assert cfg.recovery.lr_factor == 0.5
    assert cfg.sanitize.posinf == 0.0, "replace must not map +inf to the dtype max like torch.nan_to_num"


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_loads_and_validates(preset):
    cfg = load_config(CONFIGS / preset)
    assert isinstance(cfg, TrainConfig)


def test_presets_say_what_they_promise():
    strict = load_config(CONFIGS / "strict.yaml")
    assert set(strict.recovery.actions.values()) == {"abort"}, "strict stops at the first anomaly"
    assert strict.sanitize.inputs == "raise" and strict.recovery.max_retries == 0
    lenient = load_config(CONFIGS / "lenient.yaml")
    assert lenient.recovery.max_retries > load_config().recovery.max_retries
    assert "restore" in lenient.recovery.escalate and lenient.snapshot.store == "safetensors"
    assert load_config(CONFIGS / "fp16.yaml").amp.dtype == "float16"
    assert load_config(CONFIGS / "bf16.yaml").amp.dtype == "bfloat16"


def test_default_yaml_lists_every_key_with_its_default_and_a_comment():
    text = (CONFIGS / "default.yaml").read_text()
    assert load_config(CONFIGS / "default.yaml") == load_config(), "default.yaml must equal the schema defaults"
    data = yaml.safe_load(text)
    for dotted, _, _ in iter_fields(TrainConfig()):
        node = data
        for part in dotted.split("."):
            assert part in node, f"default.yaml lacks {dotted}"
            node = node[part]
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "  # " in line, f"no comment on: {line!r}"


def test_every_field_is_documented():
    for dotted, f, _ in iter_fields(TrainConfig()):
        assert f.metadata.get("doc"), f"{dotted} has no doc"


def test_file_then_overrides_take_precedence(tmp_path):
    path = write(tmp_path, "recovery:\n  max_retries: 7\n  lr_factor: 0.25\n")
    cfg = load_config(path, ["recovery.max_retries=9", "guard.clip_grad_norm=1.5", "detect.exclude=[head,'blocks.*']"])
    assert cfg.recovery.max_retries == 9, "override beats file"
    assert cfg.recovery.lr_factor == 0.25, "file beats default"
    assert cfg.guard.clip_grad_norm == 1.5
    assert cfg.detect.exclude == ("head", "blocks.*")


def test_result_is_read_only():
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.recovery.max_retries = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.recovery.actions["loss"] = "abort"  # type: ignore[index]
    assert isinstance(cfg.detect.include, tuple)


def test_one_function_accepts_path_dict_dataclass_and_dictconfig(tmp_path):
    path = write(tmp_path, "recovery:\n  max_retries: 4\n")
    expected = load_config(None, ["recovery.max_retries=4"])
    assert as_config(path) == expected
    assert as_config(str(path)) == expected
    assert as_config({"recovery": {"max_retries": 4}}) == expected
    assert as_config(expected) == expected
    assert as_config(OmegaConf.create({"recovery": {"max_retries": 4}})) == expected
    assert as_config(None) == load_config()
    assert to_dict(as_config(to_dict(expected))) == to_dict(expected)


def test_as_config_checks_a_hand_built_dataclass():
    bad = dataclasses.replace(TrainConfig(), recovery=dataclasses.replace(TrainConfig().recovery, max_retries=-2))
    with pytest.raises(ConfigError, match=r"recovery\.max_retries: got -2; expected an integer \(>= 0\)"):
        as_config(bad)


def test_as_config_rejects_other_types():
    with pytest.raises(ConfigError, match="got int; expected a YAML path, a dict, a DictConfig or a TrainConfig"):
        as_config(3)  # type: ignore[arg-type]


ERRORS = [
    # (overrides, message regex)
    (["recovery.max_retries=-1"], r"recovery\.max_retries: got -1; expected an integer \(>= 0\)"),
    (["recovery.lr_factor=1.5"], r"recovery\.lr_factor: got 1\.5; expected a number \(> 0, < 1\)"),
    (["recovery.lr_factor=0"], r"recovery\.lr_factor: got 0(\.0)?; expected a number \(> 0, < 1\)"),
    (["detect.mode=fast"], r"detect\.mode: got 'fast'; expected one of 'eager' \| 'lazy' \| 'off'"),
    (["sanitize.inputs=drop"], r"sanitize\.inputs: got 'drop'; expected one of 'skip_batch' \| 'drop_rows'"),
    (["amp.dtype=float8"], r"amp\.dtype: got 'float8'; expected one of 'float16' \| 'bfloat16' or null"),
    (["recovery.max_retrys=3"], r"unknown key 'recovery\.max_retrys'; did you mean 'recovery\.max_retries'\?"),
    (["gaurd.clip_grad_norm=1"], r"unknown key 'gaurd'; did you mean 'guard'\?"),
    (
        ["recovery.actions.loss=drop_rows"],
        r"recovery\.actions\.loss: got 'drop_rows'; expected one of warn \| skip_batch",
    ),
    (["recovery.actions.loss=explode"], r"recovery\.actions\.loss: got 'explode'; expected one of"),
    (
        ["recovery.actions.input=skip_batch"],
        r"recovery\.actions\.input: unknown anomaly kind \(input and target are set by sanitize",
    ),
    (["recovery.actions.gradeint=zero_grads"], r"did you mean 'gradient'\?"),
    (["recovery.escalate=[restore,fly]"], r"recovery\.escalate: item 1: got 'fly'; expected one of"),
    (["guard.clip_grad_norm=abc"], r"guard\.clip_grad_norm: got 'abc'; expected a number or null"),
    (["guard.clip_grad_norm=-1"], r"guard\.clip_grad_norm: got -1(\.0)?; expected a number or null \(> 0\)"),
    (["detect.check_weights_every=1.5"], r"detect\.check_weights_every: got 1\.5; expected an integer"),
    (["log.progress=maybe"], r"log\.progress: got 'maybe'; expected true or false"),
    (["guard=3"], r"guard: got 3; expected a section with keys clip_grad_norm"),
    (["sanitize.nan=inf"], r"sanitize\.nan: got inf; expected a number \(finite\)"),
    (
        ["guard.spike.min_history=200"],
        r"guard\.spike\.min_history: got 200; expected at most guard\.spike\.window \(128\)",
    ),
    (["noequals"], r"override 'noequals': expected KEY=VALUE"),
]


@pytest.mark.parametrize("overrides,message", ERRORS, ids=[e[0][0] for e in ERRORS])
def test_bad_overrides_name_key_value_and_what_is_allowed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_unknown_key_in_file_names_file_line_and_suggestion(tmp_path):
    path = write(tmp_path, "detect:\n  mode: eager\nrecovery:\n  max_retries: 3\n  lr_factr: 0.5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}:5: unknown key 'recovery.lr_factr'; did you mean 'recovery.lr_factor'?")
    assert "valid keys in recovery: actions, escalate, max_retries" in str(info.value)


def test_bad_value_in_file_names_file_and_line(tmp_path):
    path = write(tmp_path, "# comment\nrecovery:\n  lr_factor: 2.0\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: recovery\.lr_factor: got 2\.0; expected a number \(> 0, < 1\)"):
        load_config(path)
    path = write(tmp_path, "guard:\n  clip_grad_norm: big\n", "t.yaml")
    with pytest.raises(ConfigError, match=rf"^{path}:2: guard\.clip_grad_norm: got 'big'; expected a number or null"):
        load_config(path)


def test_override_error_says_it_came_from_an_override(tmp_path):
    path = write(tmp_path, "recovery:\n  lr_factor: 0.5\n")
    with pytest.raises(ConfigError, match=r"^override: recovery\.lr_factor: got 3"):
        load_config(path, ["recovery.lr_factor=3"])


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"^{missing}: no such config file; expected a YAML file or a preset's name"):
        load_config(missing)


def test_unparsable_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, "detect:\n  mode: eager\nrecovery:\n  max_retries: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"^{path}:5: cannot parse YAML: expected ',' or '\]'"):
        load_config(path)
    tabbed = write(tmp_path, "detect:\n\tmode: eager\n", "tab.yaml")
    with pytest.raises(ConfigError, match=rf"^{tabbed}:2: cannot parse YAML"):
        load_config(tabbed)


def test_yaml_that_is_not_a_mapping(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of sections \(detect:, guard:, \.\.\.\), got list"):
        load_config(path)


def test_empty_file_means_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing\n")) == load_config()


def test_bare_off_in_yaml_means_the_choice_off(tmp_path):
    """YAML 1.1 turns `off` into false; for choice fields that allow 'off' it means 'off'."""
    path = write(tmp_path, "detect:\n  mode: off\nsanitize:\n  inputs: off\n")
    cfg = load_config(path, ["sanitize.targets=off"])
    assert (cfg.detect.mode, cfg.sanitize.inputs, cfg.sanitize.targets) == ("off", "off", "off")
    assert load_config(None, ["log.progress=off"]).log.progress is False, "a boolean field keeps YAML's meaning"
    with pytest.raises(ConfigError, match=r"log\.level: got False; expected one of 'DEBUG'"):
        load_config(None, ["log.level=off"])


def test_the_sites_configuration_reference_lists_every_key_with_its_default_and_doc():
    """The reference in docs/configuration.md is generated from the schema when the site is built
    (docs/hooks/config_reference.py): every key, with its default as YAML writes it and its doc."""
    import importlib.util

    docs = CONFIGS.parent / "docs"
    assert "<!-- config-reference -->" in (docs / "configuration.md").read_text(), "the page lost its marker"
    spec = importlib.util.spec_from_file_location("config_reference", docs / "hooks" / "config_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    reference = hook.reference_markdown()
    for dotted, field, value in iter_fields(TrainConfig()):
        if dataclasses.is_dataclass(value):
            continue
        shown = dict(value) if isinstance(value, dict) or hasattr(value, "keys") else value
        default = yaml.safe_dump(shown, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
        row = f"| `{dotted}` | `{default.replace('|', chr(92) + '|')}` |"
        assert row in reference, f"the configuration reference lacks {dotted} (or its default {default})"
        assert field.metadata["doc"].replace("|", "\\|") in reference, f"the reference lacks the doc of {dotted}"


def test_a_presets_name_is_its_shipped_file_from_any_directory(tmp_path):
    """Issue #25: ``SafeTraining("configs/default.yaml")`` worked only from a checkout; the presets
    ship in the package and their names work wherever a path does, from any working directory."""
    import subprocess
    import sys

    from safetrain.config.presets import PRESETS

    for name in PRESETS:
        assert load_config(name) == load_config(f"configs/{name}.yaml")
    assert load_config("strict") != load_config("lenient")
    code = "from safetrain import as_config; c = as_config('fp16'); print(c.amp.dtype)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "float16", out.stderr
    with pytest.raises(ConfigError, match=r"no such config file; expected a YAML file or a preset's name \(default, "):
        load_config("defualt")
