"""The plot of a run: loss, gradient norm and LR scale over the steps, a marker per recovery action.

:func:`plot_run` draws what :func:`safetrain.rundir.read_run` read into a PNG through
matplotlib's object API (no pyplot, so no global figure or backend state) and the Agg renderer.
matplotlib is the ``plot`` extra, imported on first use: without it :class:`PlotUnavailable`
says how to install it, and the text report (:mod:`safetrain.cli.report`) still works.

Example::

    >>> from safetrain.rundir import read_run
    >>> plot_run(read_run("runs/demo"))                  # doctest: +SKIP
    PosixPath('runs/demo/report.png')
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple, Union

from ..rundir import ReportError, RunLog
from ..rundir.atomicfile import atomic_write_bytes

__all__ = ["PlotUnavailable", "plot_run"]

_MARKERS = {  # action -> (marker, colour); the order is the legend's
    "drop_rows": ("v", "#1f77b4"),
    "replace": ("D", "#17becf"),
    "skip_batch": ("X", "#d62728"),
    "zero_grads": ("o", "#ff7f0e"),
    "warn": ("P", "#bcbd22"),
    "restore": ("^", "#2ca02c"),
    "scale_lr": ("s", "#9467bd"),
    "abort": ("*", "#000000"),
    "clip": ("|", "#8c564b"),  # the start of an episode of clipped steps (a healthy step)
}


_LARGEST = 1e300  # the largest magnitude drawn as a value


class PlotUnavailable(ReportError):
    """matplotlib is not installed; the text report still works."""


def plot_run(run: RunLog, path: Union[None, str, os.PathLike] = None) -> Path:
    """Draw loss and gradient norm over steps with a marker per recovery action, and the LR scale below.

    Args:
        run: what :func:`safetrain.rundir.read_run` returned.
        path: the PNG to write (default ``<run_dir>/report.png``).

    Returns:
        The path written.

    Raises:
        PlotUnavailable: matplotlib is not installed (``pip install safetrain[plot]``).
        ReportError: the run has no ``metrics.csv`` rows to plot, or the PNG cannot be written
            (a directory where it goes; a link there is replaced, never written through).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "matplotlib is not installed, so no report.png; install it with: pip install 'safetrain[plot]'"
        ) from None
    if run.metrics is None or not run.metrics["step"]:
        raise ReportError(f"{run.run_dir / 'metrics.csv'}: no per-step metrics to plot")
    out = Path(path) if path is not None else run.run_dir / "report.png"
    png = _draw(run)
    try:
        atomic_write_bytes(out, png)  # a link planted at report.png is replaced, never written through
    except OSError as exc:  # a run directory that is read-only here, a full disk
        raise ReportError(f"{out}: cannot write the plot ({exc.strerror or exc})") from None
    return out


def _draw(run: RunLog) -> bytes:
    """Draw ``run`` as a PNG: loss, gradient norm (markers per action) and LR scale."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state is touched
    from matplotlib.lines import Line2D

    m = run.metrics or {}
    steps = m["step"]
    loss, gnorm, lr = (_drawable(m[name]) for name in ("loss", "grad_norm", "lr_scale"))
    by_step = {int(s): i for i, s in enumerate(steps)}
    fig = Figure(figsize=(11, 7.5), dpi=110)
    ax_loss, ax_grad, ax_lr = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.1], "hspace": 0.08}
    )
    trained = m["trained"]
    _series(ax_loss, steps, loss, trained, "loss", "#4c72b0")
    _series(ax_grad, steps, gnorm, trained, "gradient norm", "#55a868")
    marks = _marks(run)
    for ax, values in ((ax_loss, loss), (ax_grad, gnorm)):
        _markers(ax, marks, values, by_step, annotate=ax is ax_loss and len(marks) <= 30)
    ax_lr.step(steps, lr, where="post", color="#8172b2", lw=1.6)
    ax_lr.set_ylabel("LR scale")
    finite_lr = [v for v in lr if math.isfinite(v)] or [1.0]
    ax_lr.set_ylim(0, max(1.05, max(finite_lr) * 1.1))
    ax_lr.set_xlabel("step")
    for ax in (ax_loss, ax_grad, ax_lr):
        ax.grid(True, which="major", alpha=0.25)
        for step, action, _ in marks:
            if action in ("restore", "scale_lr", "abort"):
                ax.axvline(step, color=_MARKERS[action][1], lw=0.8, ls="--", alpha=0.5, zorder=0)
    _epochs(ax_loss, m)
    seen = [a for a in _MARKERS if any(a == mark[1] for mark in marks)]
    seen += sorted({a for _, a, _ in marks if a not in _MARKERS})
    handles = [
        Line2D(
            [],
            [],
            ls="",
            marker=_MARKERS.get(a, ("o", "gray"))[0],
            color=_MARKERS.get(a, ("o", "gray"))[1],
            markersize=8,
            label=a,
        )
        for a in seen
    ]
    if handles:
        ax_loss.legend(handles=handles, title="action", loc="upper right", fontsize=8, title_fontsize=8, framealpha=0.9)
    s = run.summary or {}
    title = f"{run.run_dir.name}: {s.get('steps', len(steps))} steps"
    if s:
        title += (
            f", {s.get('healthy_steps', '?')} healthy, {s.get('skipped_batches', '?')} skipped, "
            f"{s.get('dropped_rows', '?')} rows dropped, {s.get('restores', '?')} restores"
            + (f", {s['clipped_steps']} clipped" if s.get("clipped_steps") else "")
            + (" - ABORTED" if s.get("aborted") else "")
        )
    elif run.cut_at is not None or not s:
        title += " (run did not close)"
    ax_loss.set_title(title, fontsize=10, loc="left")
    fig.align_ylabels()
    png = io.BytesIO()
    fig.savefig(png, format="png", bbox_inches="tight")  # a PNG through matplotlib's Agg renderer
    return png.getvalue()


def _marks(run: RunLog) -> List[Tuple[int, str, str]]:
    """(step, action, kind) of every anomaly and recovery worth a marker, one per (step, action);
    a clip episode's start (``clipped``) too.

    An escalation journals the anomaly, the restore and the LR change at one step; one marker
    (with the anomaly's kind) says it. A data skip after a restore is not marked: the restore is.
    """
    marks, seen = [], set()
    for e in run.events:
        if (
            e["event"] not in ("anomaly", "restored", "lr_changed", "aborted", "quarantine", "clipped")
            or not e["action"]
        ):
            continue
        step, action = e["step"], e["action"]
        if e["event"] == "restored" and action not in ("restore", "scale_lr", "abort"):
            continue
        if (step, action) not in seen:
            seen.add((step, action))
            marks.append((step, action, e["kind"]))
    return marks


def _drawable(values: List[float]) -> List[float]:
    """``values`` with magnitudes over 1e300 as infinities: drawn in the NaN/Inf band, since an axis
    with headroom above them would overflow (a float64 ends at 1.8e308)."""
    return [math.copysign(math.inf, v) if abs(v) > _LARGEST else v for v in values]


def _positive(values: List[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 20


def _series(ax: Any, steps: List[float], values: List[float], trained: List[float], label: str, colour: str) -> None:
    """The raw per-step values, thin, and an EMA over trained steps only (skipped steps don't drag it)."""
    finite = [v if math.isfinite(v) else math.nan for v in values]
    ax.plot(steps, finite, color=colour, lw=0.7, alpha=0.45)
    ema, n, xs, smooth = 0.0, 0, [], []
    for x, v, t in zip(steps, finite, trained):
        if t and not math.isnan(v):
            ema, n = 0.9 * ema + 0.1 * v, n + 1
            xs.append(x)
            smooth.append(ema / (1 - 0.9**n))  # bias-corrected, as in Adam: no pull towards the first value
    ax.plot(xs, smooth, color=colour, lw=1.6)
    if _positive(values):
        ax.set_yscale("log")
    ax.set_ylabel(label + (" (log)" if ax.get_yscale() == "log" else ""))


def _markers(
    ax: Any, marks: List[Tuple[int, str, str]], values: List[float], by_step: Dict[int, int], annotate: bool
) -> None:
    """One marker per action at the step's value; non-finite values go in a grey NaN/Inf band on top.

    Several actions at (nearly) the same step are stacked so that none hides another; the first
    marker of each (kind, action) is labelled with the kind.
    """
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import offset_copy

    band = ax.get_xaxis_transform()  # x in data, y in axes fraction
    at = [values[by_step[s]] if s in by_step else math.nan for s, _, _ in marks]
    if any(not math.isfinite(v) for v in at):
        _headroom(ax, values)
        ax.add_patch(Rectangle((0, 0.9), 1, 0.1, transform=ax.transAxes, color="#999999", alpha=0.12, lw=0))
        ax.text(0.004, 0.95, "NaN/Inf", transform=ax.transAxes, fontsize=7, va="center", color="#444444")
    span = max((s for s, _, _ in marks), default=1) - min((s for s, _, _ in marks), default=0) or 1
    last_step, stacked, labelled = None, 0, set()
    for (step, action, kind), y in sorted(zip(marks, at), key=lambda m: m[0][0]):
        near = last_step is not None and step - last_step <= span / 150
        stacked = stacked + 1 if near else 0
        last_step = step if not near else last_step
        marker, colour = _MARKERS.get(action, ("o", "gray"))
        if math.isfinite(y):  # stack downwards from the value
            xy, where = (step, y), offset_copy(ax.transData, fig=ax.figure, y=-11 * stacked, units="points")
        else:  # stack sideways inside the band
            xy, where = (step, 0.95), offset_copy(band, fig=ax.figure, x=9 * stacked, units="points")
        ax.scatter(
            [xy[0]],
            [xy[1]],
            transform=where,
            marker=marker,
            color=colour,
            s=60,
            edgecolors="black",
            linewidths=0.5,
            zorder=5,
            clip_on=False,
        )
        if annotate and (kind, action) not in labelled:
            labelled.add((kind, action))
            ax.annotate(
                kind,
                xy,
                xycoords=where,
                xytext=(6, 2),
                textcoords="offset points",
                fontsize=7,
                color=colour,
                bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.75),
            )


def _headroom(ax: Any, values: List[float]) -> None:
    """Set the y range so that the finite values fill the lower 87%: the NaN/Inf band stays free."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    lo, hi = min(finite), max(finite)
    if ax.get_yscale() == "log" and lo > 0:
        low, high = math.log10(lo), math.log10(hi)
        pad = max(high - low, 0.5)
        ax.set_ylim(10 ** (low - 0.04 * pad), 10 ** (high + 0.17 * pad))
    else:
        pad = (hi - lo) or abs(hi) or 1.0
        ax.set_ylim(lo - 0.04 * pad, hi + 0.17 * pad)


def _epochs(ax: Any, m: Dict[str, List[Any]]) -> None:
    epochs, steps = m["epoch"], m["step"]
    starts = [(steps[i], int(e)) for i, e in enumerate(epochs) if i > 0 and e != epochs[i - 1]]
    if len(starts) > 30:
        return
    for step, epoch in starts:
        ax.axvline(step, color="gray", lw=0.6, alpha=0.35, zorder=0)
        ax.text(step, 0.02, f" epoch {epoch}", transform=ax.get_xaxis_transform(), fontsize=7, color="gray")
