"""The repeated blocks of a model, found by structure: what ``detect.granularity: block`` hooks.

A transformer (or a ResNet) is a stack of blocks of one class held by an ``nn.ModuleList`` or an
``nn.Sequential``: GPT-2's ``transformer.h.0``, ``transformer.h.1``..., BERT's
``encoder.layer.N``, ``nn.TransformerEncoder``'s ``layers.N``. Each block is built from a dozen
small modules (projections, norms, activations, dropouts), each of which costs one hook call and
one reduction per forward in ``module`` granularity. Every value those modules make that the rest
of the model can see leaves the block through its output (a residual stream carries every row,
masked ones included), so in ``block`` granularity one hook per block stands for its insides on
the healthy path, and the exact hooks of a re-run name the layer inside the block on a trip.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

from torch import nn

__all__ = ["repeated_blocks", "inside", "block_of"]


def repeated_blocks(named: Sequence[Tuple[str, nn.Module]]) -> Dict[str, nn.Module]:
    """The outermost repeated blocks among ``named`` (``named_modules()`` pairs, plain names).

    A block is a child of an ``nn.ModuleList`` or ``nn.Sequential`` that has children of its own
    (a leaf is its own finest granularity) and at least one sibling of the same class. A block
    inside another block is not one (the outer block's hook covers it).

    Args:
        named: ``(qualified name, module)`` pairs, parents before children (``named_modules()`` order).

    Returns:
        Block name -> block, in ``named`` order.

    Example::

        >>> layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
        >>> model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        >>> list(repeated_blocks(list(model.named_modules())))
        ['layers.0', 'layers.1']
    """
    by_name = dict(named)
    blocks: Dict[str, nn.Module] = {}
    for name, module in named:
        if not name or inside(name, blocks) or not any(True for _ in module.children()):
            continue
        parent = by_name.get(name.rpartition(".")[0])
        if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
            continue
        if sum(1 for sibling in parent.children() if type(sibling) is type(module)) >= 2:
            blocks[name] = module
    return blocks


def inside(name: str, blocks: Dict[str, nn.Module]) -> bool:
    """``True`` when ``name`` is strictly inside one of ``blocks`` (a block's descendant)."""
    prefix = name
    while "." in prefix:
        prefix = prefix.rpartition(".")[0]
        if prefix in blocks:
            return True
    return False


def block_of(name: str, blocks: Dict[str, nn.Module]) -> str:
    """The block ``name`` is in (itself when it is a block), or ``""`` when it is in none."""
    prefix = name
    while prefix:
        if prefix in blocks:
            return prefix
        prefix = prefix.rpartition(".")[0]
    return ""
