"""What the Lightning callback reaches inside Lightning's objects, each behind one function.

Imported by :mod:`safetrain.integrations.lightning` only; it imports nothing from Lightning (the
objects are handed in), so the core never needs Lightning installed. Each entry says what it is,
since when (checked against the Lightning source, 2.2 to 2.6) and what breaks in safetrain if it
goes; ``tests/unit/adapters/test_adapters.py`` fails when one changes.

``LightningModule.log`` / ``log_dict``, replaced on the instance (:func:`silenced_logging`)
    The guard's own forwards (re-runs of ``training_step`` for ``drop_rows``/``retry``, replays for
    diagnosis) must log nothing: their values are not the run's, and ``self.log`` outside
    Lightning's own ``training_step`` call raises or files the value under the wrong hook. The
    two methods are shadowed by instance attributes for the duration and the instance's own
    attributes (normally none) put back after, on an exception too. If Lightning stops looking
    ``log`` up on the instance (a ``__slots__`` module, a descriptor), a replay's values land in
    the run's logged metrics or raise ``MisconfigurationException`` inside the guard.

``trainer.precision_plugin.scaler`` (:func:`precision_scaler`; ``MixedPrecision`` and
``FSDPPrecision`` hold it, since 2.0)
    Lightning's fp16 ``GradScaler``, which the guard must share (it unscales once, reads the
    overflow flag and divides Lightning's scaled loss by the scale). If it goes: the guard sees no
    scaler, judges every fp16 overflow a gradient anomaly and records losses times the scale.

``trainer.precision_plugin.forward_context()`` (:func:`forward_context`; since 2.0)
    The autocast context Lightning runs ``training_step`` under; the guard's re-runs use it so a
    re-run computes what the original step did. If it goes: re-runs run in full precision.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional

import torch

__all__ = ["silenced_logging", "precision_scaler", "forward_context"]

_LOGGING = ("log", "log_dict")
_ABSENT = object()


def _nothing(*args: Any, **kwargs: Any) -> None:
    """``LightningModule.log`` inside :func:`silenced_logging`."""


@contextlib.contextmanager
def silenced_logging(module: torch.nn.Module) -> Iterator[None]:
    """``module.log`` and ``module.log_dict`` do nothing inside the block (the guard's own forwards
    of ``training_step`` log nothing); after it, even on an exception, the module's methods are as
    they were (the class's, or whatever the instance held). Nests.

    Example::

        >>> with silenced_logging(pl_module):  # doctest: +SKIP
        ...     loss = pl_module.training_step(batch, 0)
    """
    own = vars(module)
    before = {name: own.get(name, _ABSENT) for name in _LOGGING}
    for name in _LOGGING:
        own[name] = _nothing  # an instance attribute: found before the class's method
    try:
        yield
    finally:
        for name, value in before.items():
            if value is _ABSENT:
                own.pop(name, None)
            else:
                own[name] = value


def precision_scaler(trainer: Any) -> Optional[torch.amp.GradScaler]:
    """The fp16 ``GradScaler`` of the trainer's precision plugin (``16-mixed``), or ``None``
    (32-bit, ``bf16-mixed``, a plugin without one)."""
    return getattr(trainer.precision_plugin, "scaler", None)  # only the mixed-precision plugins have one


def forward_context(trainer: Any) -> ContextManager[Any]:
    """The context Lightning runs ``training_step`` under (autocast for mixed precision)."""
    return trainer.precision_plugin.forward_context()
