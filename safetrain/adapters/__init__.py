"""Adapters for other libraries: the one place each private thing of torch, Lightning, accelerate
and transformers that safetrain reads or patches is named, and the loss scaler built on them.

* :mod:`.scaler`: :class:`FP16Scaler` (a GradScaler for one optimizer) and :class:`NoScaler`
  (the same methods, no cost), made by :func:`make_scaler`; the guard holds one, never ``None``.
* :mod:`.torch_private`: GradScaler's per-optimizer stage, overflow flags and scale tensor; the
  profiler flag; the autograd engine's end-of-backward callback.
* :mod:`.compiled`: ``torch.compile``'s wrapper and its private ``_orig_mod``: the names the user's
  code uses (snapshot keys, monitored modules), replays kept out of dynamo.
* :mod:`.lightning_private`: silencing ``LightningModule.log``; the precision plugin's scaler and
  forward context (imported by the Lightning integration only).
* :mod:`.huggingface_private`: unwrapping accelerate's optimizer, its scaler and gradient state,
  the once-per-step unscale, transformers' loss-kwargs rule (imported by the Hugging Face
  integration only; accelerate is imported lazily).

Each module's docstring lists what it touches, since which version, and what breaks if it goes;
``tests/unit/adapters/test_adapters.py`` holds a contract test for each that fails when a release changes it.
"""

from __future__ import annotations

from .scaler import FP16Scaler, NoScaler, Scaler, make_scaler

__all__ = ["FP16Scaler", "NoScaler", "Scaler", "make_scaler"]
