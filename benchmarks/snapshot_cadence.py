"""Cost of ``snapshot.every: auto`` on healthy runs against ``snapshot.every: 100`` (issue #32).

The guarded step (``Guard.step``, default configuration otherwise) of ``benchmarks/overhead.py``'s
models, with snapshots every 100 healthy steps (the previous default) and with ``auto`` (the new
one: ``ceil(snapshot time / (snapshot.overhead x step time))`` healthy steps, within
``snapshot.min_every..max_every``), against the plain loop; variants interleaved, their order
rotated each round, medians with min-max (``overhead.measure``), 20 steps of a variant at a time
(``--block``; the guard's own clock measures a healthy step from its end to the next one's, so with
one step at a time it would count the other variants' steps too). After the table, each model's
measured snapshot and step times and the interval ``auto`` chose.

Run: ``.venv/bin/python benchmarks/snapshot_cadence.py --seconds 20``
"""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead  # noqa: E402
from fit_overhead import guard_variant  # noqa: E402
from overhead import Setup, Variant, register_variant  # noqa: E402

#: Per model, what the ``auto`` guard measured: (snapshot s, step s, interval), printed at the end.
PLANS: Dict[str, List[tuple]] = {}


def _cadence_variant(s: Setup, every: str) -> Variant:
    variant = guard_variant(s, "eager", overrides=[f"snapshot.every={every}"])
    guard = inspect.getclosurevars(variant.step).nonlocals["guard"]  # the guard the variant steps
    if every == "auto":
        cadence = guard.snapshots.cadence
        stop = variant.stop

        def stopped() -> None:
            stop()
            PLANS.setdefault(type(s.model).__name__, []).append((cadence.snapshot_s, cadence.step_s, cadence.every))

        return Variant(variant.step, variant.start, stopped)
    return variant


@register_variant("every_100")
def every_100(s: Setup) -> Variant:
    return _cadence_variant(s, "100")


@register_variant("every_auto")
def every_auto(s: Setup) -> Variant:
    return _cadence_variant(s, "auto")


def _ms(seconds: Optional[float]) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds is not None else "-"


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a.startswith("--variants") for a in argv):
        argv += ["--variants", "plain,every_100,every_auto"]
    if not any(a.startswith("--block") for a in argv):
        argv += ["--block", "20"]
    code = overhead.main(argv)
    for model, plans in PLANS.items():
        snap, step, every = plans[-1]
        print(f"{model}: snapshot {_ms(snap)}, healthy step {_ms(step)} -> every {every}")
    sys.exit(code)
