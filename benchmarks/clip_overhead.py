"""Overhead of adaptive (ZClip) gradient clipping against fixed clipping, on ``fit_overhead.py``'s models.

Variants (each ``Guard.step`` with the default configuration, as ``fit_overhead.py``'s ``guard``):

- ``guard_clip``: ``guard.clip_grad_norm=1.0`` (fixed);
- ``guard_zclip``: ``guard.clip.mode=adaptive`` (no ceiling: it multiplies the gradients only on
  a z-score outlier, which a fixed batch rarely makes);
- ``guard_zclip_ceiling``: adaptive with ``guard.clip_grad_norm=1.0`` as its ceiling: the same
  gradient multiply as ``guard_clip`` every step, plus the statistics, so against ``guard_clip``
  it isolates what the adaptive rule itself costs (a few float operations on the host per step).

Run: ``.venv/bin/python benchmarks/clip_overhead.py --variants guard_clip,guard_zclip,guard_zclip_ceiling``
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import overhead  # noqa: E402
from fit_overhead import guard_variant  # noqa: E402
from overhead import Setup, Variant, register_variant  # noqa: E402


def clip_variant(s: Setup, overrides: List[str]) -> Variant:
    """``Guard.step`` with the default configuration and ``overrides``, as a variant."""
    return guard_variant(s, "eager", overrides=overrides)


@register_variant("guard_clip")
def guard_clip(s: Setup) -> Variant:
    return clip_variant(s, ["guard.clip_grad_norm=1.0"])


@register_variant("guard_zclip")
def guard_zclip(s: Setup) -> Variant:
    return clip_variant(s, ["guard.clip.mode=adaptive"])


@register_variant("guard_zclip_ceiling")
def guard_zclip_ceiling(s: Setup) -> Variant:
    return clip_variant(s, ["guard.clip.mode=adaptive", "guard.clip_grad_norm=1.0"])


if __name__ == "__main__":
    sys.exit(overhead.main())
