"""How an anomaly's evidence reads in the journal: one line of it, the batch it names, its JSON payload.

The recovery executor (:mod:`.recovery`) writes each anomaly's event with these: :func:`summary`
says what was found in words, :func:`place_of` which ``(epoch, batch index)`` the event names.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["summary", "place_of", "event_payload", "micro_batch"]


def place_of(detail: Mapping[str, Any], diagnosis: Any = None) -> Optional[Tuple[int, int]]:
    """The ``(epoch, batch index)`` an anomaly's event names: the micro-batch a replay pinned it on,
    else its finding's (a forward finding in one micro-batch, the first micro-batch with bad rows,
    the step's own for a finding about the whole step); ``None``: the step's."""
    for found in (diagnosis, detail.get("finding"), (detail.get("rows") or [None])[0]):
        epoch, batch = getattr(found, "epoch", None), getattr(found, "batch_index", None)
        if epoch is not None and batch is not None:
            return int(epoch), int(batch)
    return None


def micro_batch(path: str) -> str:
    """Which micro-batch a row finding's path is in: ``micro[i]`` of an accumulated step, else
    ``batch`` (a row bad in several tensors of one batch, ``batch["x"]`` and ``batch["z"]``, is one row)."""
    return path.split("]")[0] if path.startswith("micro[") else "batch"


def event_payload(detail: Mapping[str, Any], diagnosis: Any) -> Dict[str, Any]:
    """An anomaly's evidence (and its diagnosis, when one ran) as the event's JSON-ready detail."""
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
