"""The configuration presets shipped in the package, by name: ``default``, ``lenient``, ``strict``,
``fp16``, ``bf16`` (``safetrain/config/presets/<name>.yaml``; a checkout's ``configs/`` is the same
directory). Wherever a config path is accepted, a preset's bare name is too, so an installed user
needs no checkout. No torch.

Example::

    >>> preset_path("strict").name
    'strict.yaml'
    >>> preset_path("configs/strict.yaml") is None  # a path is a path
    True
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Optional, Tuple, Union

__all__ = ["PRESETS", "preset_path"]

#: The presets' names, in the order the documentation (docs/configuration.md) shows them.
PRESETS: Tuple[str, ...] = ("default", "lenient", "strict", "fp16", "bf16")


def preset_path(name: Union[str, "os.PathLike[str]"]) -> Optional[Path]:
    """The file of the preset ``name`` (a bare name: no directory, no suffix), or ``None`` when
    ``name`` is not a preset's name (then it is a path)."""
    text = os.fspath(name)
    if text not in PRESETS:
        return None
    return Path(str(resources.files(__package__) / "presets" / f"{text}.yaml"))
