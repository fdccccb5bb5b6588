"""Overhead of the whole guarded step (``Guard.step``, what ``SafeTrainer.fit`` runs per batch)
against a plain loop, with the DEFAULT configuration: sanitizer, activation hooks (eager) or not
(lazy), fused gradient check, weight check every 100 steps, spike detector, replay bookkeeping,
a memory snapshot every 100 healthy steps, one host sync per step.

It reuses ``benchmarks/overhead.py``'s models, runner and table (interleaved, rotated, medians
with min-max) and adds the variants ``guard`` (default config) and ``guard_lazy``
(``detect.mode=lazy``). ``fit`` adds only a Python loop over the loader around ``Guard.step``.

Run: ``.venv/bin/python benchmarks/fit_overhead.py --variants guard,guard_lazy,eager,lazy``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Sequence

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead  # noqa: E402
from overhead import Setup, Variant, register_variant  # noqa: E402

import safetrain  # noqa: E402


def guard_variant(s: Setup, mode: str, package: Any = safetrain, overrides: Sequence[str] = ()) -> Variant:
    """``Guard.step`` of ``package`` (a ``safetrain``, the current one by default) in ``mode``, with
    the config ``overrides`` (dotted ``KEY=VALUE``), as a variant."""
    amp = [f"amp.dtype={str(s.amp).replace('torch.', '')}"] if s.amp is not None else []
    cfg = package.load_config(
        None, ["log.progress=false", f"detect.mode={mode}", "log.level=WARNING", *amp, *overrides]
    )
    guard = package.Guard(s.model, s.optimizer, cfg, loss_fn=s.loss_fn)
    guard.monitor.detach()  # the model is shared with the other variants: hooks only around our steps
    batch = (s.inputs, s.targets)

    def step() -> None:
        result = guard.step(batch)
        if result is None or result.action:
            raise RuntimeError(f"benchmark step was not healthy: {result}")

    def start() -> None:
        # Every variant frees one set of gradients inside its timed step: the plain loop frees the
        # previous variant's at its start, the guard frees its own at its end. The gradients the
        # previous variant left on the shared model are dropped here, outside the timing, as
        # nobody would leave them between two guarded steps of a real run.
        s.optimizer.zero_grad(set_to_none=True)
        guard.monitor.attach()

    return Variant(step, start, guard.monitor.detach)


@register_variant("guard")
def guard_eager(s: Setup) -> Variant:
    return guard_variant(s, "eager")


@register_variant("guard_lazy")
def guard_lazy(s: Setup) -> Variant:
    return guard_variant(s, "lazy")


if __name__ == "__main__":
    sys.exit(overhead.main())
