"""How the recovery executor words an anomaly for the journal: its evidence in one line, the
micro-batch it is about, its payload, and an abort's hint at the cause and fix. No effects.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from ..kinds import Kind

__all__ = ["with_hint", "place_of", "summary", "payload_of", "micro_batch_of"]


def with_hint(reason: str, kind: str, diagnosis: Any, masked_targets: int, steps: int) -> str:
    """An abort's ``reason`` with what it adds about the cause and its fix: NaN targets a finite
    loss masks (in most of the ``steps`` so far), or a known optimizer numerics fault not yet named.

    Example::

        >>> with_hint("target: 8 of the first 8 steps were not trained", "target", None, 8, 8)[:60]
        'target: 8 of the first 8 steps were not trained; the targets'
    """
    if kind == Kind.TARGET and masked_targets * 2 > steps:
        return reason + (
            f"; the targets held NaN in {masked_targets} of {steps} steps while the loss on them was finite: NaN "
            "looks like a missing-value marker the loss masks (its gradient is still NaN through torch.where); "
            "fix: sanitize.targets: replace (sanitize.nan sets the value the loss then sees), or mask the NaN "
            "targets out before the loss is computed (select the valid rows, or torch.where on the targets)"
        )
    known = str(getattr(diagnosis, "numerics", "") or "")
    return f"{reason}; {known}" if known and known not in reason else reason


def place_of(detail: Mapping[str, Any], diagnosis: Any = None) -> Optional[Tuple[int, int]]:
    """The ``(epoch, batch index)`` an anomaly's event names: the micro-batch a replay pinned it on,
    else its finding's (a forward finding in one micro-batch, the first micro-batch with bad rows,
    the step's own for a finding about the whole step); ``None``: the step's."""
    for found in (diagnosis, detail.get("finding"), (detail.get("rows") or [None])[0]):
        epoch, batch = getattr(found, "epoch", None), getattr(found, "batch_index", None)
        if epoch is not None and batch is not None:
            return int(epoch), int(batch)
    return None


def micro_batch_of(path: str) -> str:
    """Which micro-batch a row finding's path is in: ``micro[i]`` of an accumulated step, else
    ``batch`` (a row bad in several tensors of one batch, ``batch["x"]`` and ``batch["z"]``, is one row)."""
    return path.split("]")[0] if path.startswith("micro[") else "batch"


def payload_of(detail: Mapping[str, Any], diagnosis: Any) -> Dict[str, Any]:
    out = {k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in detail.items()}
    if diagnosis is not None:
        out["diagnosis"] = diagnosis.to_dict()
    return out


def summary(kind: str, detail: Mapping[str, Any]) -> str:
    """One line for an anomaly's evidence: its finding, or the spike's or loss's numbers."""
    finding = detail.get("finding")
    if finding is not None and hasattr(finding, "describe"):
        return finding.describe()
    rows = detail.get("rows")
    if isinstance(rows, list) and rows and hasattr(rows[0], "describe"):  # bad input or target rows
        return "; ".join(f.describe() for f in rows[:4])
    if kind == "spike" and detail.get("rule") == "start":
        start = ", ".join(f"{x:.4g}" for x in detail["start"])
        return (
            f"loss {detail['loss']:.4g} after {detail['trained']} trained step(s) is {detail['ratio']:.3g} ranges "
            f"above the lowest of the start model's losses on the batches ahead ({start}) and the trained ones"
        )
    if kind == "spike":
        return f"loss {detail['loss']:.4g} is {detail['z']:.1f} robust sigmas above the median {detail['median']:.4g}"
    if kind == "loss":
        return f"loss is {detail['loss']}"
    return ", ".join(f"{k}={v}" for k, v in detail.items() if not isinstance(v, (list, dict)))
