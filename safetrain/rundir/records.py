"""What a sound run-directory record is: a journal event, the closing summary, a ``metrics.csv`` row.

:mod:`safetrain.rundir.runlog` reads the files; this module judges each record once, where it is read,
and returns it with every known field present and of its type, or raises :class:`Unsound` with
the reason it cannot be used (``step is not an integer >= 0 (got 'abc')``). Journals get
concatenated, hand-edited and written by older or newer versions and by other tools: a record
that fails is skipped and named, and the report, its cross-check and the plot read sound records
only, with no checks of their own. Unknown fields and unknown event names are kept. Pure
functions on plain values; nothing here imports torch.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

__all__ = [
    "SUMMARY_COUNTERS",
    "MAX_STEP",
    "METRICS_COLUMNS",
    "Unsound",
    "sound_event",
    "sound_summary",
    "sound_metrics_row",
    "one_line",
]

#: Steps (and other counts) must be below this: every such integer is exact as a float.
MAX_STEP = 2**53
#: The columns of ``metrics.csv``, as :class:`safetrain.rundir.MetricsWriter` writes them.
METRICS_COLUMNS = ("step", "epoch", "batch", "loss", "grad_norm", "lr_scale", "trained", "action")

_NAME_LEN = 100  # event, kind, action, run id, ended: short identifiers, shown in the report's table
_REQUIRED = object()
#: The counters of a run's summary (``FitResult``'s), in the order the report shows them.
SUMMARY_COUNTERS = (
    "steps",
    "optimizer_steps",
    "healthy_steps",
    "skipped_batches",
    "dropped_rows",
    "replaced_rows",
    "zeroed_grads",
    "restores",
    "scaler_skips",
    "warnings",
    "lr_backoffs",
    "retries",
    "rejected_batches",
    "clipped_steps",
)
#: Summary fields that count something (the counters, where the run stood, the journal's length).
_COUNTS = (*SUMMARY_COUNTERS, "epoch", "batch", "events")
_REALS = ("lr_scale", "final_loss", "wall_time")  # floats; the writer spells a non-finite one "nan", "inf"
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class Unsound(ValueError):
    """A record that cannot be used; ``str()`` is the reason, naming the field and what it held."""


def _shown(value: Any) -> str:
    """``value`` for a message: ASCII only, at most 40 characters."""
    text = ascii(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _get(record: Mapping[str, Any], key: str, default: Any) -> Any:
    if key in record:
        return record[key]
    if default is _REQUIRED:
        raise Unsound(f"{key} is missing")
    return default


def _integer(record: Mapping[str, Any], key: str, low: int, default: Any = _REQUIRED, prefix: str = "") -> int:
    """``record[key]`` as an int in ``[low, MAX_STEP)``; an integral float (``5.0``) counts."""
    value = _get(record, key, default)
    number = int(value) if isinstance(value, float) and value.is_integer() else value
    if isinstance(number, bool) or not isinstance(number, int) or not low <= number < MAX_STEP:
        raise Unsound(f"{prefix}{key} is not an integer >= {low} (got {_shown(value)})")
    return number


def _name(record: Mapping[str, Any], key: str, default: Any = _REQUIRED, prefix: str = "") -> str:
    """``record[key]`` as a short printable string (it is printed in a table)."""
    value = _get(record, key, default)
    if not isinstance(value, str) or len(value) > _NAME_LEN or not value.isprintable():
        raise Unsound(f"{prefix}{key} is not a short printable string (got {_shown(value)})")
    return value


def _real(record: Mapping[str, Any], key: str, prefix: str = "") -> float:
    """``record[key]`` as a float: a number, or the strings ``nan``, ``inf``, ``-inf``."""
    value = record[key]
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unsound(f"{prefix}{key} is not a number (got {_shown(value)})")
    try:
        return float(value)
    except OverflowError:  # an integer too large for a float
        raise Unsound(f"{prefix}{key} is out of range (got {_shown(value)})") from None


def one_line(text: str) -> str:
    r"""``text`` on one printable line: whitespace runs become one space, other non-printables escaped
    (``\x1b``, ``\u202e``), so that a string read from a file cannot move the cursor, clear the
    screen or reorder what a terminal shows. Everything the CLI prints from a file goes through it.

    Example::

        >>> one_line("ok\x1b[2J\n  done")
        'ok\\x1b[2J done'
    """
    text = " ".join(text.split())
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def sound_event(record: Any) -> Dict[str, Any]:
    """A journal event record, checked: ``event`` and ``step`` required, the other known fields defaulted.

    Fields: ``event``, ``kind``, ``action`` (short printable strings; ``""`` by default), ``step``
    (an integer >= 0), ``epoch`` and ``batch`` (integers >= -1; -1 by default), ``rank`` (>= 0),
    ``message`` (a string), ``detail`` (an object; ``{}`` for null or missing), ``time`` (a finite
    number or null). In ``detail``: ``run_id`` of a ``run_started`` (a short string or null) and
    ``count`` of an input or target anomaly (an integer >= 0), which the reader and the cross-check use.

    Returns:
        A new dict: the record's fields (unknown ones kept) with every known field present.

    Raises:
        Unsound: a field is missing or not of its type and range; the message names it.

    Example::

        >>> sound_event({"event": "anomaly", "step": 5, "kind": "loss"})["epoch"]
        -1
        >>> try:
        ...     sound_event({"event": "anomaly", "step": "5"})
        ... except Unsound as exc:
        ...     print(exc)
        step is not an integer >= 0 (got '5')
    """
    if not isinstance(record, dict):
        raise Unsound(f"not a JSON object (got {_shown(record)})")
    out = dict(record)
    out["event"] = _name(record, "event")
    if not out["event"]:
        raise Unsound("event is empty")
    out["step"] = _integer(record, "step", 0)
    out["epoch"] = _integer(record, "epoch", -1, default=-1)
    out["batch"] = _integer(record, "batch", -1, default=-1)
    out["rank"] = _integer(record, "rank", 0, default=0)
    out["kind"] = _name(record, "kind", default="")
    out["action"] = _name(record, "action", default="")
    out["message"] = _get(record, "message", "")
    if not isinstance(out["message"], str):
        raise Unsound(f"message is not a string (got {_shown(out['message'])})")
    detail = _get(record, "detail", None)
    if detail is None:
        detail = {}
    if not isinstance(detail, dict):
        raise Unsound(f"detail is not an object (got {_shown(detail)})")
    out["detail"] = detail = dict(detail)
    if out["event"] == "run_started" and detail.get("run_id") is not None:
        detail["run_id"] = _name(detail, "run_id", prefix="detail.")
    if out["event"] == "anomaly" and out["kind"] in ("input", "target"):
        detail["count"] = _integer(detail, "count", 0, default=0, prefix="detail.")
    out["time"] = when = _get(record, "time", None)
    if when is not None and (isinstance(when, bool) or not isinstance(when, (int, float)) or not _finite(when)):
        raise Unsound(f"time is not a finite number (got {_shown(when)})")
    return out


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def sound_summary(record: Mapping[str, Any]) -> Dict[str, Any]:
    """The closing ``summary`` line's fields, checked (the ``event`` key dropped).

    Counters (``steps``, ``restores``... and ``events``) are integers >= 0 (``epoch``, ``batch``
    >= -1); ``lr_scale``, ``final_loss``, ``wall_time`` floats (``"nan"`` read as NaN);
    ``aborted`` a boolean; ``ended`` a short printable string; ``error`` a string (put on one
    line) or null. Absent fields stay absent; unknown ones are kept.

    Raises:
        Unsound: a field is not of its type and range; the message names it.
    """
    out = {k: v for k, v in record.items() if k != "event"}
    prefix = "summary "
    for key in _COUNTS:
        if key in out:
            out[key] = _integer(out, key, -1 if key in ("epoch", "batch") else 0, prefix=prefix)
    for key in _REALS:
        if key in out:
            out[key] = _real(out, key, prefix=prefix)
    if "aborted" in out and not isinstance(out["aborted"], bool):
        raise Unsound(f"{prefix}aborted is not true or false (got {_shown(out['aborted'])})")
    if "ended" in out:
        out["ended"] = _name(out, "ended", prefix=prefix)
    if out.get("error") is not None:
        if not isinstance(out["error"], str):
            raise Unsound(f"{prefix}error is not a string (got {_shown(out['error'])})")
        out["error"] = one_line(out["error"])
    return out


def sound_metrics_row(header: Sequence[str], cells: Sequence[str]) -> List[Any]:
    """One ``metrics.csv`` row, checked against its header: the values of :data:`METRICS_COLUMNS`, in order.

    ``step`` is an integer >= 0, ``epoch`` and ``batch`` integers >= -1, ``loss``, ``grad_norm``
    and ``lr_scale`` floats (``nan`` and ``inf`` allowed), ``trained`` 0 or 1, ``action`` a short
    printable string. Columns the header adds are not read.

    Args:
        header: the file's header row (it holds every name in :data:`METRICS_COLUMNS`).
        cells: the row's cells, as many as the header's.

    Raises:
        Unsound: the row has the wrong number of cells, or a cell is not of its column's type.

    Example::

        >>> sound_metrics_row(METRICS_COLUMNS, ["3", "0", "2", "nan", "0.5", "1", "0", "skip_batch"])[:4]
        [3.0, 0.0, 2.0, nan]
    """
    if len(cells) != len(header):
        raise Unsound(f"{len(cells)} cells, expected {len(header)}")
    row = dict(zip(header, cells))
    values: List[Any] = []
    for name in METRICS_COLUMNS:
        cell = row[name]
        if name == "action":
            values.append(_name(row, name))
            continue
        number = _float(cell)
        if number is None:
            raise Unsound(f"{name} is not a number (got {_shown(cell)})")
        if name == "trained" and number not in (0.0, 1.0):
            raise Unsound(f"trained is not 0 or 1 (got {_shown(cell)})")
        if name in ("step", "epoch", "batch"):
            low = 0 if name == "step" else -1
            if not (number.is_integer() and low <= number < MAX_STEP):
                raise Unsound(f"{name} is not an integer >= {low} (got {_shown(cell)})")
        values.append(number)
    return values


def _float(cell: str) -> Optional[float]:
    try:
        return float(cell)
    except ValueError:
        return None
