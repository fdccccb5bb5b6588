"""Model wrappers that rename things: ``torch.compile``'s ``OptimizedModule``.

``torch.compile(model)`` returns a wrapper whose parameter names and ``state_dict`` keys carry
an ``_orig_mod.`` segment that the module's own do not, so a checkpoint saved through it does not
load into the same model run without ``torch.compile`` (pytorch/pytorch#101107,
karpathy/nanoGPT#325). The guard names things through :func:`unwrap_compiled` and
:func:`plain_namer`, and snapshots key the model's tensors by the plain names, so names and
snapshots are the same compiled or not. :func:`run_eagerly` keeps the replays out of dynamo.

What of torch's is private here (this package's rule: what, since when, what breaks if it goes;
``tests/unit/adapters/test_compiled.py`` fails when a release changes it):

``OptimizedModule`` (``torch._dynamo.eval_frame``, since 2.0; checked in 2.13)
    The wrapper ``torch.compile(model)`` returns, found in ``sys.modules`` (dynamo is not imported
    for it). If it moves: :func:`is_compiled` answers ``False`` and names keep ``_orig_mod.``.
``OptimizedModule._orig_mod`` (since 2.0; checked in 2.13)
    The module the wrapper holds, and the segment it adds to every name. If it goes:
    :func:`unwrap_compiled` fails, and a compiled model's snapshots do not load uncompiled.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, List, Optional, Type, TypeVar

import torch

__all__ = ["unwrap_compiled", "is_compiled", "plain_namer", "run_eagerly", "can_force_eager"]

_T = TypeVar("_T")

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
    # every path of a wrapper registered twice (one compiled block reused in several places)
    wrappers = {name for name, module in model.named_modules(remove_duplicate=False) if is_compiled(module)}
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


def can_force_eager() -> bool:
    """Whether this torch has compile stances (2.6 and later), so :func:`run_eagerly` can make
    ``torch.compile``d code run eagerly; before, it only keeps dynamo from tracing the call."""
    return hasattr(torch.compiler, "set_stance")


def run_eagerly(fn: Callable[[], _T]) -> _T:
    """``fn()`` with every ``torch.compile``d model or function inside it run eagerly.

    The replays run the model under a ``TorchDispatchMode`` and with every module hooked; traced
    by dynamo, such a forward would compile a graph of its own or leave the model's code marked
    as not compilable, and the run would go on uncompiled. The call is also kept out of dynamo's
    tracing when it is made from compiled code (a user's compiled train step that calls the guard).

    Args:
        fn: the work, without arguments.

    Returns:
        What ``fn`` returns. Without dynamo ever imported (nothing compiled), a plain call.
    """
    if "torch._dynamo" not in sys.modules:
        return fn()
    return _eager_runner()(fn)


def _forced_eager(fn: Callable[[], _T]) -> _T:
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return fn()
    with set_stance("force_eager"):
        return fn()


_runner: Optional[Callable[[Callable[[], Any]], Any]] = None


def _eager_runner() -> Callable[[Callable[[], Any]], Any]:
    """:func:`_forced_eager` out of dynamo's reach, built on first use (dynamo's import is slow)."""
    global _runner
    if _runner is None:
        _runner = torch.compiler.disable(_forced_eager)
    return _runner
