"""How many random healthy runs get an intervention (issue 32, point 5): a count, not a test.

Draws ``N`` runs from the generator of ``tests/helpers/healthy.py`` (task, activation,
normalisation, optimizer, offset, scale, schedule, accumulation, noisier batches, seed), each drawn
with ``random.Random(i)`` for ``i`` in ``[start, start + N)`` (so other seeds than the property
test's), runs each through ``SafeTrainer.fit`` for 80 steps with the default configuration, and
prints every run with an anomaly, restore or abort event, then the count.

A run listed here is not necessarily a false alarm: compare it with the same run unguarded (a
plain loop of the same model, data and optimizer) before calling it one.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/healthy_interventions.py 300 0``
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers.healthy import fit, interventions  # noqa: E402

CHOICES: Dict[str, tuple] = {
    "task": ("mse", "ce", "nll"),
    "act": ("tanh", "relu", "gelu"),
    "norm": ("layer", "batch"),
    "optimizer": ("sgd", "adam", "adamw"),
    "offset": (0.0, -1.0, -100.0, 100.0, 3.0),
    "scale": (1.0, 0.01, 100.0),
    "schedule": ("none", "cosine", "onecycle"),
    "accumulate": (1, 1, 2, 4),
    "noisy_every": (0, 7, 10),
}


def draw(rng: random.Random) -> Dict[str, Any]:
    """One run's arguments, as the property test draws them (SGD keeps scale 1: its step is not scale-invariant)."""
    kw: Dict[str, Any] = {k: rng.choice(v) for k, v in CHOICES.items()}
    kw["seed"] = rng.randint(0, 1000)
    if kw["optimizer"] == "sgd":
        kw["scale"] = 1.0
    return kw


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    start = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    hit, began = 0, time.perf_counter()
    for i in range(start, start + n):
        kw = draw(random.Random(i))
        result, _ = fit(**kw, steps=80)
        found = interventions(result)
        if found or result.ended != "done":
            hit += 1
            print(json.dumps({"i": i, **kw, "ended": result.ended}), found, flush=True)
    print(f"{hit} of {n} healthy runs intervened ({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
