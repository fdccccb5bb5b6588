"""A fault's signature, to tell a fault that comes back after a restore from a new one. No torch.

The policy (:mod:`safetrain.policy`) remembers the last fault's :class:`Signature` (its kind, the
parameters or module it is in, the op that made it) and whether a restore came after it. When the
same fault is the next anomaly after a restore, the restore did not fix it: it is *persistent*.
Rolling back again replays it; an LR backoff changes only magnitudes, not a ``0 / 0`` made from
finite values. So the policy stops spending retries on it:

* at once (the first recurrence) when the diagnosis names a known cause that no recovery action
  changes (:attr:`~safetrain.diagnose.Diagnosis.numerics`: an optimizer ``eps`` the dtype cannot hold);
* after :data:`PERSISTENT_AFTER` recurrences in a row otherwise (a restore, then LR backoffs).

Example::

    >>> a = Signature("weights", ("embed.weight",), "aten.addcdiv_.default")
    >>> a == Signature.from_dict(a.to_dict())
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from ..kinds import Kind

__all__ = ["Signature", "signature_of", "broken_for", "persistent_reason", "PERSISTENT_KINDS", "PERSISTENT_AFTER"]

#: Kinds a fault signature is taken of: those with a place (parameters, module, op). Divergence,
#: spikes, gradient norms and the fp16 scaler are magnitudes, which an LR backoff does change.
PERSISTENT_KINDS = frozenset({Kind.WEIGHTS, Kind.FORWARD, Kind.LOSS, Kind.GRADIENT})

#: Recurrences in a row, each right after a restore, after which a fault with no known cause aborts.
PERSISTENT_AFTER = 3


@dataclass(frozen=True)
class Signature:
    """Where a fault is: enough to recognise it when it comes back, small enough for a snapshot.

    Attributes:
        kind: the anomaly kind.
        where: the non-finite parameters, or the module whose output went non-finite (sorted).
        op: the op that made the first non-finite value from finite inputs, when a replay named it.
    """

    kind: str
    where: Tuple[str, ...] = ()
    op: Optional[str] = None

    def describe(self) -> str:
        """``weights in embed.weight by aten.addcdiv_.default``."""
        names = ", ".join(self.where[:4]) + (f" (+{len(self.where) - 4})" if len(self.where) > 4 else "")
        return f"{self.kind}" + (f" in {names}" if names else "") + (f" by {self.op}" if self.op else "")

    def to_dict(self) -> dict:
        """JSON-ready form (part of the policy history, so of every snapshot)."""
        return {"kind": self.kind, "where": list(self.where), "op": self.op}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Signature":
        """Inverse of :meth:`to_dict`."""
        return cls(str(data["kind"]), tuple(str(x) for x in data.get("where", ())), data.get("op"))


def signature_of(kind: Kind, detail: Mapping[str, Any], diagnosis: Any = None) -> Optional[Signature]:
    """The signature of an anomaly from its finding (``detail["finding"]``) and its diagnosis.

    ``None`` for a kind outside :data:`PERSISTENT_KINDS`, or when nothing names a place.
    """
    if kind not in PERSISTENT_KINDS:
        return None
    finding = detail.get("finding")
    op = getattr(diagnosis, "op", None) if getattr(diagnosis, "reproducible", False) else None
    if kind is Kind.WEIGHTS:
        where = tuple(getattr(diagnosis, "nonfinite_weights", ()) or getattr(finding, "nonfinite", ()) or ())
    else:
        module = getattr(diagnosis, "module", None)
        module = module if module is not None else getattr(finding, "module", None)
        where = (module,) if module is not None else tuple(getattr(finding, "nonfinite", ()) or ())
    if not where and op is None:
        return None
    return Signature(str(kind), tuple(sorted(str(w) for w in where)), op)


def broken_for(detail: Mapping[str, Any], diagnosis: Any = None) -> int:
    """For a ``weights`` fault: the steps from the update that broke the weights (the weight
    replay's ``weights_step``) to the step that found them, each of which was counted healthy
    though it was not. ``0`` when unknown (no replay named the update)."""
    found = getattr(detail.get("finding"), "step", None)
    made = getattr(diagnosis, "weights_step", None)
    if isinstance(found, int) and isinstance(made, int) and found > made:
        return found - made
    return 0


def persistent_reason(signature: Signature, recurrences: int, diagnosis: Any = None) -> str:
    """Why a fault that came back ``recurrences`` times in a row, each right after a restore, ends
    the run now; ``""`` while retrying may still change it."""
    known = str(getattr(diagnosis, "numerics", "") or "")
    where = signature.describe()
    if recurrences >= 1 and known:
        return (
            f"{signature.kind}: persistent fault: {where} came back right after a restore, and its cause is "
            f"the optimizer's numerics, which no restore or LR backoff changes: {known}"
        )
    if recurrences >= PERSISTENT_AFTER:
        return (
            f"{signature.kind}: persistent fault: {where} came back right after each of the last "
            f"{recurrences} restores; restores and LR backoffs do not change it (a NaN made from finite values "
            "does not depend on their size): fix the op or the data that makes it"
        )
    return ""
