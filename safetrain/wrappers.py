"""Model wrappers that rename things: ``torch.compile``'s ``OptimizedModule``.

``torch.compile(model)`` returns a wrapper whose parameter names and ``state_dict`` keys carry
an ``_orig_mod.`` segment that the module's own do not, so a checkpoint saved through it does not
load into the same model run without ``torch.compile`` (pytorch/pytorch#101107,
karpathy/nanoGPT#325). The guard names things through :func:`unwrap_compiled` and snapshots key
the model's tensors by :func:`plain_name`, so names and snapshots are the same compiled or not.
"""

from __future__ import annotations

import sys
from typing import Optional, Type

import torch

__all__ = ["unwrap_compiled", "is_compiled", "plain_name"]

_SEGMENT = "_orig_mod."


def _wrapper_type() -> Optional[Type[torch.nn.Module]]:
    """dynamo's ``OptimizedModule``, if dynamo was imported (no model can be compiled before)."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (``model.compile()`` in place is not one)."""
    wrapper = _wrapper_type()
    return wrapper is not None and isinstance(model, wrapper)


def unwrap_compiled(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``torch.compile`` wrapper (nested ones too), else ``model`` itself.

    Both share every parameter and buffer; the inner module's names have no ``_orig_mod.``.

    Args:
        model: any module.

    Returns:
        The innermost module that is not a compile wrapper.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> unwrap_compiled(torch.compile(net)) is net
        True
    """
    while is_compiled(model):
        model = model._orig_mod
    return model


def plain_name(name: str) -> str:
    """A parameter or module name without the ``_orig_mod.`` segments of compile wrappers inside
    it (``module._orig_mod.fc.weight`` of ``DDP(torch.compile(m))`` -> ``module.fc.weight``)."""
    if _SEGMENT not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")
