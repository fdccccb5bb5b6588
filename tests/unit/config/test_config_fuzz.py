"""Fuzzing load_config (issue 26, point 2): over YAML texts, bytes and override strings, only
``ConfigError`` ever escapes, and a config that loads is valid.

The texts are built from the real keys with hostile values (interpolations, ``???``, wrong types,
deep or odd YAML), then damaged (a line repeated, dropped or cut, bytes spliced in), so that most
examples get past the parser and reach the merge, the resolution and the validation.
60 examples per test by default; ``SAFETRAIN_FUZZ_EXAMPLES=800`` for a longer hunt (all passed).
"""

from __future__ import annotations

import os

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safetrain import ConfigError, TrainConfig, load_config
from safetrain.config import iter_fields, validate

KEYS = [dotted for dotted, _, _ in iter_fields(TrainConfig())]
SECTIONS = sorted({k.split(".")[0] for k in KEYS} | {k.rsplit(".", 1)[0] for k in KEYS if k.count(".") > 1})
UNSET = "SAFETRAIN_FUZZ_UNSET"
os.environ.pop(UNSET, None)
os.environ.setdefault("SAFETRAIN_FUZZ_WORD", "seven")

TRICKY = [
    "${oc.env:HOME}",
    f"${{oc.env:{UNSET}}}",
    f"${{oc.env:{UNSET},3}}",
    "${oc.env:SAFETRAIN_FUZZ_WORD}",
    "${recovery.max_retries}",
    "${recovery.nope}",
    "${log.dir}",
    "${guard.spike}",
    "${.window}",
    "${..x}",
    "${oc.decode:'[1'}",
    "${oc.decode:'{a: 1}'}",
    "${oc.decode:'2'}",
    "${oc.create:'{a: 1}'}",
    "${oc.select:recovery.nope,4}",
    "${oc.dict.keys:recovery}",
    "${oc.dict.values:recovery.actions}",
    "${nosuch:x}",
    "${",
    "}",
    "$",
    "${}",
    "???",
    "a${recovery.max_retries}b",
    "off",
    "true",
    "null",
    "nan",
    "-.inf",
    "1e400",
    "0x1F",
    "",
    "restore",
    "skip_batch",
    "[a, b]",
    "{a: 1}",
    "${log.dir}" * 64,  # nested repeats (issue 36): bounded before they are resolved
    "${snapshot.dir}${snapshot.dir}" * 32,
    "${detect.include}" * 16,
    "x" * 20_000,
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(TRICKY),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=4)
    ),
    max_leaves=10,
)
# Mostly real keys with scalar values, so that most examples get past the key check.
real_keys = st.sampled_from(KEYS)
keys = st.one_of(real_keys, real_keys, real_keys, st.sampled_from(SECTIONS), st.text(min_size=1, max_size=12))
leaf_values = st.one_of(st.sampled_from(TRICKY), st.sampled_from(TRICKY), scalars, values)


def nest(pairs: list) -> dict:
    """Dotted keys to a nested dict; a key that collides with a section replaces it."""
    root: dict = {}
    for dotted, value in pairs:
        node = root
        parts = str(dotted).split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return root


@st.composite
def yaml_texts(draw: st.DrawFn, damaged: bool) -> bytes:
    """A YAML config built from real keys with hostile values; ``damaged``: then damaged."""
    data = nest(draw(st.lists(st.tuples(keys if damaged else real_keys, leaf_values), max_size=6)))
    text = yaml.safe_dump(data, default_flow_style=draw(st.sampled_from([False, True, None])), allow_unicode=True)
    if not damaged:
        return text.encode("utf-8")
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        damage = draw(st.sampled_from(["repeat", "drop", "cut", "tab", "splice"]))
        if damage == "repeat":  # the same key twice: a duplicate
            lines.insert(i, lines[i])
        elif damage == "drop":
            lines.pop(i)
        elif damage == "cut":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif damage == "tab":
            lines[i] = "\t" + lines[i]
        else:
            lines[i] = lines[i] + draw(st.text(max_size=8))
    raw = "".join(lines).encode("utf-8")
    if draw(st.booleans()) and raw:
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(max_size=4)) + raw[at:]
    return raw


def key_values(names: st.SearchStrategy) -> st.SearchStrategy:
    """``KEY=VALUE`` strings: a tricky or random value as text, or any value written as YAML."""
    return st.one_of(
        st.builds(lambda k, v: f"{k}={v}", names, st.one_of(st.sampled_from(TRICKY), st.text(max_size=12))),
        st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}", names, leaf_values),
    )


overrides = st.lists(key_values(real_keys), max_size=3)
any_overrides = st.lists(st.one_of(key_values(keys), st.text(max_size=16)), max_size=3)

FUZZ = settings(
    max_examples=int(os.environ.get("SAFETRAIN_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def load_or_config_error(path, items) -> None:
    try:
        cfg = load_config(path, items)
    except ConfigError as exc:
        assert str(exc).strip(), "an error must say something"
        return
    validate(cfg)  # what loads is valid


@FUZZ
@given(text=yaml_texts(damaged=False), items=overrides)
def test_only_config_error_escapes_over_yaml_texts_and_overrides(text, items, tmp_path):
    """Fails before: InterpolationResolutionError, InterpolationKeyError, a yaml ScannerError or
    ReaderError from an override value, IndexError from an override key... escaped as tracebacks."""
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text)
    load_or_config_error(path, items)


@FUZZ
@given(text=yaml_texts(damaged=True), items=any_overrides)
def test_only_config_error_escapes_over_damaged_yaml_texts(text, items, tmp_path):
    """Fails before: UnicodeDecodeError, and the errors above."""
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text)
    load_or_config_error(path, items)


@FUZZ
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_only_config_error_escapes_over_arbitrary_bytes(raw, tmp_path):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(raw)
    load_or_config_error(path, [])


@FUZZ
@given(items=any_overrides)
def test_only_config_error_escapes_over_overrides_alone(items):
    load_or_config_error(None, items)
