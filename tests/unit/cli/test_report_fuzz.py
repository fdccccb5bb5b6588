"""Fuzzing the run directory's reader and ``safetrain report`` (issue 26, point 1): journals and
metrics files of random shape - valid JSON with wrong types in every known field, missing and
extra fields, nesting, huge numbers, NaN/Infinity literals, bytes that are not UTF-8, blank
lines, a cut last line; metrics rows with huge fields, wrong cell counts and non-numbers. The
reader never raises and hands over sound records only; ``safetrain report`` exits 0 with the
report and no traceback."""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safetrain.cli import main
from safetrain.cli.report import format_report, reconcile
from safetrain.rundir import ReportError, read_run
from safetrain.rundir.records import MAX_STEP, METRICS_COLUMNS
from tests.helpers.bounds import bounded

EVENTS = ["run_started", "anomaly", "restored", "snapshot", "lr_changed", "aborted", "quarantine", "run_ended"]
SUMMARY_KEYS = ["steps", "restores", "dropped_rows", "events", "lr_scale", "final_loss", "aborted", "ended", "error"]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["nan", "inf", "-inf", "\u2028", "\ud800", "a\nb", "x" * 300]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
# every known field: mostly a value of its type, often anything at all
good = {
    "event": st.sampled_from(EVENTS) | st.text(max_size=8),
    "step": st.integers(0, 50),
    "epoch": st.integers(-1, 3),
    "batch": st.integers(-1, 9),
    "kind": st.sampled_from(["input", "target", "loss", "spike", "scaler", "run"]),
    "action": st.sampled_from(["", "start", "resume", "drop_rows", "replace", "skip_batch", "restore", "scale_lr"]),
    "message": st.text(max_size=10),
    "detail": st.fixed_dictionaries(
        {}, optional={"count": st.integers(0, 5) | json_values, "run_id": st.sampled_from(["a", "b"]) | json_values}
    ),
    "rank": st.integers(0, 3),
    "time": st.floats(0, 2e9),
}
records = st.fixed_dictionaries({}, optional={k: v | json_values for k, v in good.items()}).flatmap(
    lambda r: st.dictionaries(st.text(max_size=5), json_values, max_size=2).map(lambda extra: {**extra, **r})
)
summaries = st.fixed_dictionaries(
    {"event": st.just("summary")},
    optional={k: st.integers(0, 20) | st.sampled_from(["nan", True, "done"]) | json_values for k in SUMMARY_KEYS},
)


def _encode(value, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")  # NaN/Infinity literals


raw_lines = st.one_of(
    st.binary(max_size=30),  # not UTF-8, not JSON
    st.sampled_from([b"", b"   ", b"\r", b'{"event": "anomaly", "step": 1e999}', b"[" * 5000 + b"]" * 5000]),
    st.just(b'{"event": "anomaly", "step": ' + b"9" * 5000 + b"}"),  # over Python's int-from-string limit
    json_values.map(lambda v: _encode(v, True)),
)
journal_lines = st.lists(
    st.one_of(
        st.tuples(records, st.booleans()).map(lambda t: _encode(*t)),
        st.tuples(summaries, st.booleans()).map(lambda t: _encode(*t)),
        raw_lines,
    ),
    max_size=8,
)

good_cells = {
    "step": st.integers(0, 30).map(str),
    "epoch": st.integers(-1, 3).map(str),
    "batch": st.integers(-1, 9).map(str),
    "loss": st.floats(allow_nan=True, allow_infinity=True).map(repr),
    "grad_norm": st.sampled_from(["0.5", "nan", "inf", "1e308", "-1e308"]),
    "lr_scale": st.sampled_from(["1", "0.5", "nan", "1e300"]),
    "trained": st.sampled_from(["0", "1"]),
    "action": st.sampled_from(["", "skip_batch", "restore"]),
}
bad_cells = st.one_of(st.text(max_size=6), st.sampled_from(["1e999", "-1", "2.5", '"', "x" * 140_000]))
metrics_rows = st.lists(
    st.one_of(
        st.tuples(*(good_cells[c] | bad_cells for c in METRICS_COLUMNS)).map(",".join),
        st.lists(bad_cells, max_size=10).map(",".join),  # wrong cell counts
        st.binary(max_size=20).map(lambda b: b.decode("latin-1")),
    ),
    max_size=8,
)
headers = st.one_of(
    st.just(",".join(METRICS_COLUMNS)),
    st.permutations(METRICS_COLUMNS).map(",".join),
    st.lists(st.sampled_from([*METRICS_COLUMNS, "extra"]), max_size=9).map(",".join),
)


def _write(root: Path, lines, end: bytes, header, rows) -> None:
    (root / "events.jsonl").write_bytes(b"\n".join(lines) + end)
    if header is not None:
        text = "\n".join([header, *rows]) + "\n"
        (root / "metrics.csv").write_bytes(text.encode("utf-8", "surrogateescape"))


def check_sound(run) -> None:
    """What the report, the cross-check and the plot rely on: every known field there, of its type."""
    for e in run.events:
        for key in ("event", "kind", "action", "message"):
            assert isinstance(e[key], str), (key, e)
        for key, low in (("step", 0), ("epoch", -1), ("batch", -1), ("rank", 0)):
            assert type(e[key]) is int and low <= e[key] < MAX_STEP, (key, e)
        assert isinstance(e["detail"], dict) and (e["time"] is None or math.isfinite(e["time"])), e
        if e["event"] == "anomaly" and e["kind"] in ("input", "target"):
            assert type(e["detail"]["count"]) is int and e["detail"]["count"] >= 0, e
        if e["event"] == "run_started":
            assert e["detail"].get("run_id") is None or isinstance(e["detail"]["run_id"], str), e
    if run.metrics is not None:
        assert {len(v) for v in run.metrics.values()} <= {len(run.metrics["step"])}
        assert all(math.isfinite(s) and s >= 0 and s == int(s) for s in run.metrics["step"])
    if run.summary is not None:
        assert all(type(run.summary[k]) is int for k in ("steps", "restores", "events") if k in run.summary)
    for s in run.skipped + run.metrics_skipped:
        assert s.reason.isprintable() and len(s.reason) < 200, s


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    lines=journal_lines,
    end=st.sampled_from([b"\n", b"", b'\n{"event": "anomaly", "st', b"\n\xe2\x82"]),
    header=st.none() | headers,
    rows=metrics_rows,
)
def test_read_run_and_report_never_raise(lines, end, header, rows):
    """Also (issue 36): each journal is read and reported within a second, in bounded memory."""
    with tempfile.TemporaryDirectory() as tmp, bounded():
        root = Path(tmp)
        _write(root, lines, end, header, rows)
        run = read_run(root)
        check_sound(run)
        physical = (b"\n".join(lines) + end).count(b"\n") + 1  # a raw line may hold a newline of its own
        assert len(run.events) + len(run.skipped) + (run.cut_at is not None) <= physical + 1
        text = format_report(run)
        assert all(line.isprintable() for line in text.splitlines()), text
        reconcile(run)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["report", "--no-plot", str(root)])
        assert code == 0 and err.getvalue() == "" and out.getvalue() == text + "\n"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lines=journal_lines, header=headers, rows=metrics_rows)
def test_plot_draws_the_sound_records_or_says_why_not(lines, header, rows):
    pytest.importorskip("matplotlib")
    from safetrain.cli.plot import plot_run

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, lines, b"\n", header, rows)
        run = read_run(root)
        try:
            png = plot_run(run)
        except ReportError as exc:
            assert "metrics" in str(exc) or "plot" in str(exc), exc
        else:
            assert png.read_bytes()[:4] == b"\x89PNG"
