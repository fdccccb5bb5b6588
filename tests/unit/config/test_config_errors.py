"""Configuration errors never trace back (issue 26, point 2): files, interpolations, overrides.

Each bad file, interpolation or override is one ``ConfigError`` naming the file and line (or the
override), the key and what is wrong; ``safetrain check-config`` prints it as one line and exits 2.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from safetrain import ConfigError, as_config, load_config
from safetrain.cli import main
from safetrain.config import yamlfile
from safetrain.config.overrides import override_notes

ROOT = Path(__file__).resolve().parents[3]
UNSET = "SAFETRAIN_TEST_UNSET_VARIABLE"

# (name, file content, message after "{path}:"): one line naming the line, the key and the problem.
BAD_FILES = [
    (
        "env_unset",
        b"recovery:\n  max_retries: ${oc.env:" + UNSET.encode() + b"}\n",
        rf"2: recovery\.max_retries: cannot resolve '\$\{{oc\.env:{UNSET}\}}': Environment variable '{UNSET}' not "
        r"found; set it, or give a default: \$\{oc\.env:NAME,default\}$",
    ),
    (
        "env_wrong_type",
        b"recovery:\n  max_retries: ${oc.env:SAFETRAIN_TEST_WORD}\n",
        r"2: recovery\.max_retries: got 'seven'; expected an integer \(the value of '\$\{oc\.env:SAFETRAIN_TEST_WORD",
    ),
    (
        "env_not_a_bool",
        b"log:\n  progress: ${oc.env:SAFETRAIN_TEST_TWO}\n",
        r"2: log\.progress: got '2'; expected true or false \(the value of '\$\{oc\.env:SAFETRAIN_TEST_TWO\}'\)$",
    ),
    (
        "env_out_of_range",
        b"# lenient\nrecovery:\n  lr_factor: ${oc.env:SAFETRAIN_TEST_TWO}\n",
        r"3: recovery\.lr_factor: got 2\.0; expected a number \(> 0, < 1\) \(the value of '\$\{oc\.env:SAFETRAIN_",
    ),
    (
        "dangling",
        b"recovery:\n  max_retries: ${recovery.nope}\n",
        r"2: recovery\.max_retries: cannot resolve '\$\{recovery\.nope\}': the key 'recovery\.nope' not found in the",
    ),
    (
        "cycle_of_one",
        b"recovery:\n  max_retries: ${recovery.max_retries}\n",
        r"2: recovery\.max_retries: cannot resolve '\$\{recovery\.max_retries\}': it refers back to itself",
    ),
    (
        "cycle_of_two",
        b"recovery:\n  max_retries: ${recovery.reset_after}\n  reset_after: ${recovery.max_retries}\n",
        r"\d: recovery\.(max_retries|reset_after): cannot resolve .*an interpolation cycle",
    ),
    (
        "unknown_resolver",
        b"log:\n  dir: ${nosuch:x}\n",
        r"2: log\.dir: cannot resolve '\$\{nosuch:x\}': Unsupported interpolation type nosuch$",
    ),
    (
        "decode_gives_a_mapping",
        b"log:\n  dir: \"${oc.decode:'{a: 1}'}\"\n",
        r"2: log\.dir: got \{'a': 1\}; expected a string or null \(the value of",
    ),
    (
        "decode_bad_grammar",
        b"recovery:\n  max_retries: ${oc.decode:'[1'}\n",
        r"2: recovery\.max_retries: cannot resolve",
    ),
    ("bad_interpolation_grammar", b"log:\n  dir: ${\n", r"2: log\.dir: .*'\$\{'"),
    (
        "item_interpolation",
        b"detect:\n  include: [a, '${oc.env:" + UNSET.encode() + b"}']\n",
        r"2: detect\.include\[1\]",
    ),
    ("not_utf8", b"# caf\xe9\nrecovery:\n  max_retries: 2\n", r"1: not UTF-8 text \(byte 0xe9 at offset 5\); expected"),
    ("utf16", "recovery:\n  max_retries: 2\n".encode("utf-16"), r"1: not UTF-8 text \(byte 0xff at offset 0\)"),
    ("binary", bytes(range(256)) * 4, r"2: not UTF-8 text \(byte 0x80 at offset 128\)"),
    (
        "nul_bytes",
        b"recovery:\n  max_retries: 2\x00\n",
        r"2: cannot parse YAML: character #x0000 is not allowed \(special characters are not allowed\)$",
    ),
    (
        "two_documents",
        b"recovery:\n  max_retries: 2\n---\nlog: {}\n",
        r"3: cannot parse YAML: but found another document$",
    ),
    (
        "top_level_list",
        b"- recovery\n- log\n",
        r"1: expected a mapping of sections \(detect:, guard:, \.\.\.\), got list$",
    ),
    ("top_level_scalar", b"42\n", r"1: expected a mapping of sections .*got int$"),
    (
        "tab_indented",
        b"recovery:\n\tmax_retries: 2\n",
        r"2: cannot parse YAML: found character '\\t' that cannot start any",
    ),
    ("int_key", b"recovery:\n  1: 2\n", r"2: unknown key 'recovery\.1'; valid keys in recovery: actions, "),
    (
        "int_key_in_a_mapping",
        b"recovery:\n  actions: {1: restore}\n",
        r"2: recovery\.actions: got \{1: 'restore'\}; exp",
    ),
    ("unhashable_key", b"recovery:\n  [a]: 1\n", r"2: cannot parse YAML: found unhashable key$"),
    (
        "missing_mark",
        b"log:\n  dir: '???'\n",
        r"2: log\.dir: got '\?\?\?' \(OmegaConf's mark for a value still to be given",
    ),
    (
        "python_tag",
        b"log:\n  dir: !!python/object:os.system x\n",
        r"2: cannot parse YAML: could not determine a constructor",
    ),
    ("too_deep", b"detect:\n  include: " + b"[" * 5000 + b"]" * 5000 + b"\n", r"( nested too deeply|expands to)"),
]


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    monkeypatch.setenv("SAFETRAIN_TEST_WORD", "seven")
    monkeypatch.setenv("SAFETRAIN_TEST_TWO", "2")


@pytest.mark.parametrize("name,content,message", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_each_bad_file_is_one_config_error_naming_file_line_and_key(name, content, message, tmp_path, env, capsys):
    """Fails before for env_*, dangling, cycle_*, unknown_resolver, decode_*, item_interpolation,
    not_utf8, utf16, binary: a traceback (InterpolationResolutionError, UnicodeDecodeError...)."""
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "\n" not in str(info.value)
    assert re.search(f"^{re.escape(str(path))}:{message}", str(info.value)), str(info.value)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("safetrain check-config: error: ") and "Traceback" not in err, err


def test_the_five_cases_of_the_issue_exit_2_with_one_line_in_a_real_process(tmp_path):
    """Issue 26: each of these ended `safetrain check-config` with a traceback and exit code 1."""
    files = {
        "env.yaml": b"recovery:\n  max_retries: ${oc.env:" + UNSET.encode() + b"}\n",
        "type.yaml": b"recovery:\n  max_retries: ${oc.env:HOME}\n",
        "dangling.yaml": b"recovery:\n  max_retries: ${recovery.nope}\n",
        "latin1.yaml": b"# r\xe9glages\nrecovery:\n  max_retries: 2\n",
        "dir.yaml": None,
    }
    for name, content in files.items():
        if content is None:
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_bytes(content)
    code = (
        "import sys\nfrom safetrain.cli import main\n"
        "for path in sys.argv[1:]:\n    print(main(['check-config', path]), flush=True)\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != UNSET}
    proc = subprocess.run(
        [sys.executable, "-c", code, *(str(tmp_path / n) for n in files)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environ,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["2"] * len(files), proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == len(files) and "Traceback" not in proc.stderr, proc.stderr
    for line, name in zip(lines, files):
        assert line.startswith(f"safetrain check-config: error: {tmp_path / name}"), line
    assert "is a directory; expected a YAML config file" in lines[-1]


def test_an_unreadable_file_is_named(tmp_path, monkeypatch):
    """Tests run as root, where chmod 000 does not deny a read: `open` is made to raise the
    PermissionError a normal user gets. Fails before: PermissionError traceback."""
    path = tmp_path / "secret.yaml"
    path.write_text("recovery:\n  max_retries: 2\n")

    def denied(file, *args, **kwargs):
        if os.fspath(file) == os.fspath(path):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(yamlfile, "open", denied, raising=False)
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read the config file: Permission denied$"):
        load_config(path)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads a chmod 000 file anyway")
def test_an_unreadable_file_is_named_for_real(tmp_path):
    path = tmp_path / "secret.yaml"
    path.write_text("recovery:\n  max_retries: 2\n")
    path.chmod(0)
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read the config file: Permission denied$"):
        load_config(path)


def test_a_directory_and_a_huge_file_are_named(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: is a directory; expected a YAML config file$"):
        load_config(tmp_path)
    huge = tmp_path / "huge.yaml"
    huge.write_bytes(b"# " + b"x" * yamlfile.MAX_FILE_BYTES + b"\n")
    with pytest.raises(ConfigError, match=rf"^{huge}: is over {yamlfile.MAX_FILE_BYTES} bytes; expected a YAML"):
        load_config(huge)


def test_a_device_is_read_bounded(tmp_path):
    """/dev/zero never ends: the read stops at the size limit."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    with pytest.raises(ConfigError, match=r"^/dev/zero: is over \d+ bytes"):
        load_config("/dev/zero")


DUPLICATES = [
    # (file, key, first line, second line)
    ("recovery:\n  max_retries: 2\n  lr_factor: 0.5\n  max_retries: 9\n", "recovery.max_retries", 2, 4),
    ("recovery:\n  actions:\n    loss: skip_batch\n    loss: restore\n", "recovery.actions.loss", 3, 4),
    ("guard:\n  spike: {window: 64, zscore: 5.0, window: 32}\n", "guard.spike.window", 2, 2),
    ("log:\n  level: INFO\nrecovery:\n  max_retries: 2\nlog:\n  progress: false\n", "log", 1, 5),
    ("recovery:\n  max_retries: 2\n  0x1: a\n  1: b\n", "recovery.1", 3, 4),
]


@pytest.mark.parametrize("text,key,first,again", DUPLICATES, ids=[d[1] + f"@{d[3]}" for d in DUPLICATES])
def test_a_duplicate_key_is_refused_naming_both_lines(text, key, first, again, tmp_path, capsys):
    """PyYAML keeps the last of two equal keys silently. Fails before: `max_retries: 2` then
    `max_retries: 9` loaded as 9 with no word."""
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    expected = f"{path}:{again}: duplicate key '{key}' (first on line {first}, again on line {again}); "
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(expected), str(info.value)
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_anchors_merge_keys_and_equal_names_in_two_sections_are_not_duplicates(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(
        "guard:\n"
        "  spike: &on {enabled: true}\n"
        "  divergence:\n"
        "    <<: *on\n"
        "    enabled: false\n"  # overrides the merged key: what merge keys are for
        "    steps: 4\n"
        "detect:\n  include: &names [attn, mlp]\n  nan_only: *names\n"
    )
    cfg = load_config(path)
    assert cfg.guard.spike.enabled is True and cfg.guard.divergence.enabled is False
    assert cfg.guard.divergence.steps == 4 and cfg.detect.nan_only == ("attn", "mlp")


def test_interpolations_that_resolve_still_work(tmp_path, monkeypatch):
    monkeypatch.setenv("SAFETRAIN_TEST_RETRIES", "7")
    monkeypatch.setenv("SAFETRAIN_TEST_FLAG", "False")
    path = tmp_path / "ok.yaml"
    path.write_text(
        "recovery:\n  max_retries: ${oc.env:SAFETRAIN_TEST_RETRIES}\n  reset_after: ${recovery.max_retries}\n"
        "log:\n  dir: ${oc.env:HOME}/runs\n  progress: ${oc.env:SAFETRAIN_TEST_FLAG}\n"
        f"snapshot:\n  every: ${{oc.env:{UNSET},50}}\n"
    )
    cfg = load_config(path, ["detect.include=['${oc.env:SAFETRAIN_TEST_RETRIES}']"])
    assert cfg.recovery.max_retries == 7 and cfg.recovery.reset_after == 7
    assert cfg.log.dir == os.environ["HOME"] + "/runs" and cfg.log.progress is False
    assert cfg.snapshot.every == 50 and cfg.detect.include == ("7",)


BAD_OVERRIDES = [
    (f"recovery.max_retries=${{oc.env:{UNSET}}}", r"^override: recovery\.max_retries: cannot resolve .*not found"),
    ("recovery.max_retries=${recovery.nope}", r"^override: recovery\.max_retries: cannot resolve .*'recovery\.nope'"),
    ("recovery.max_retries=${oc.env:HOME}", r"^override: recovery\.max_retries: got '/.*'; expected an integer \(the"),
    ("log.dir=[1", r"^override 'log\.dir=\[1': cannot parse the value: while parsing a flow sequence"),
    ("log.dir={", r"^override 'log\.dir=\{': cannot parse the value: "),
    ("log.dir=${", r"^override 'log\.dir=\$\{': cannot parse the value: no viable alternative at input"),
    ("log..dir=x", r"^override 'log\.\.dir=x': the key 'log\.\.dir' has an empty part; expected a dotted key"),
    ("recovery.max_retries", r"^override 'recovery\.max_retries': expected KEY=VALUE, e\.g\. recovery\.max_ret"),
    ("=5", r"^override '=5': expected KEY=VALUE"),
    ("recovery.max_retries=???", r"^override: recovery\.max_retries: got '\?\?\?' \(OmegaConf's mark"),
    ("recovery.actions={1: restore}", r"^override: recovery\.actions: got \{1: 'restore'\}; expected a mapping of str"),
]


@pytest.mark.parametrize("override,message", BAD_OVERRIDES, ids=[b[0] for b in BAD_OVERRIDES])
def test_each_bad_override_is_one_config_error_naming_it(override, message, monkeypatch, capsys):
    """Fails before for the interpolations and the unparsable values: a traceback."""
    monkeypatch.delenv(UNSET, raising=False)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    assert main(["check-config", str(ROOT / "configs" / "default.yaml"), override]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_overrides_that_are_not_a_list_of_strings_are_refused():
    with pytest.raises(ConfigError, match=r"^overrides: got the string 'recovery\.max_retries=3'; expected a list"):
        load_config(None, "recovery.max_retries=3")
    with pytest.raises(ConfigError, match=r"^override 3: got int; expected a KEY=VALUE string$"):
        load_config(None, ["recovery.max_retries=3", 3])
    with pytest.raises(ConfigError, match=r"^config path: got int; expected a path to a YAML file, or None$"):
        load_config(3)


def test_a_key_set_twice_by_overrides_keeps_the_last_with_a_note(caplog, capsys):
    """The last wins, as on most command lines; the log and check-config's output say so."""
    overrides = ["recovery.max_retries=3", "log.level=DEBUG", "recovery.max_retries=4"]
    with caplog.at_level(logging.INFO, logger="safetrain"):
        assert load_config(None, overrides).recovery.max_retries == 4
    note = "recovery.max_retries is set twice by the overrides ('3', then '4'); the last, '4', wins"
    assert [r.getMessage() for r in caplog.records] == [f"config: {note}"]
    assert override_notes(overrides) == [note]
    assert main(["check-config", str(ROOT / "configs" / "default.yaml"), *overrides]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"# note: {note}"
    assert yaml.safe_load(out)["recovery"]["max_retries"] == 4


def test_no_note_when_each_key_is_set_once(caplog):
    with caplog.at_level(logging.INFO, logger="safetrain"):
        load_config(None, ["recovery.max_retries=3", "recovery.reset_after=4"])
    assert not caplog.records


def test_a_dictconfig_with_an_unresolvable_interpolation_is_a_config_error(monkeypatch):
    monkeypatch.delenv(UNSET, raising=False)
    cfg = OmegaConf.create({"recovery": {"max_retries": f"${{oc.env:{UNSET}}}"}})
    with pytest.raises(ConfigError, match=r"^DictConfig: recovery\.max_retries: cannot resolve: Environment variable"):
        as_config(cfg)
    with pytest.raises(ConfigError, match=r"^recovery\.max_retries: cannot resolve '\$\{oc\.env:"):
        as_config({"recovery": {"max_retries": f"${{oc.env:{UNSET}}}"}})


def test_the_demo_notes_no_repeat_of_its_own_defaults_and_reads_its_config_bounded(tmp_path, caplog):
    """`safetrain demo snapshot.every=50` overrides the demo's default of 25: no "set twice" note;
    and `--config /dev/zero` is refused instead of read for ever by the demo's own key scan."""
    from safetrain.cli.demo import demo_config

    with caplog.at_level(logging.INFO, logger="safetrain"):
        assert demo_config(None, ["snapshot.every=50"], tmp_path / "run").snapshot.every == 50
    assert not [r for r in caplog.records if "set twice" in r.getMessage()]
    if os.path.exists("/dev/zero"):
        with pytest.raises(ConfigError, match=r"^/dev/zero: is over \d+ bytes"):
            demo_config("/dev/zero", [], tmp_path / "run")
