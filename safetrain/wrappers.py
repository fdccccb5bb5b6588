"""Model wrappers that rename things: ``torch.compile``'s ``OptimizedModule``.

``torch.compile(model)`` returns a wrapper whose parameter names and ``state_dict`` keys carry
an ``_orig_mod.`` segment that the module's own do not, so a checkpoint saved through it does not
load into the same model run without ``torch.compile`` (pytorch/pytorch#101107,
karpathy/nanoGPT#325). The guard names things through :func:`unwrap_compiled` and
:func:`plain_namer`, and snapshots key the model's tensors by the plain names, so names and
snapshots are the same compiled or not. :func:`eager_only` keeps the replays out of dynamo.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator, List, Optional, Type

import torch

__all__ = ["unwrap_compiled", "is_compiled", "plain_namer", "eager_only"]

_SEGMENT = "_orig_mod"


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


def plain_namer(model: torch.nn.Module) -> Callable[[str], str]:
    """A function from ``model``'s parameter, buffer and module names to the names the user's code
    uses: the ``_orig_mod`` segment of every ``torch.compile`` wrapper inside ``model`` dropped
    (``module._orig_mod.fc.weight`` of ``DDP(torch.compile(m))`` -> ``module.fc.weight``).

    Only segments that follow a compile wrapper are dropped: a submodule of the user's that
    happens to be called ``_orig_mod`` keeps its name.

    Args:
        model: the module whose names will be translated.

    Returns:
        The translation (the identity when ``model`` holds no compile wrapper).
    """
    wrappers = {name for name, module in model.named_modules() if is_compiled(module)}
    if not wrappers:
        return _same

    def plain(name: str) -> str:
        out: List[str] = []
        path = None  # the original path walked so far (None: the root)
        for part in name.split(".") if name else ():
            if not (part == _SEGMENT and (path or "") in wrappers):
                out.append(part)
            path = part if path is None else f"{path}.{part}"
        return ".".join(out)

    return plain


def _same(name: str) -> str:
    return name


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Run ``torch.compile``d code eagerly inside the block (``torch.compiler.set_stance``).

    The replays run the model under a ``TorchDispatchMode`` and with every module hooked; traced
    by dynamo, such a forward would compile a graph of its own or leave the model's code marked
    as not compilable, and the run would go on uncompiled. A no-op when dynamo was never imported
    or the torch is older than 2.6 (no stances).
    """
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None or "torch._dynamo" not in sys.modules:
        yield
        return
    with set_stance("force_eager"):
        yield
