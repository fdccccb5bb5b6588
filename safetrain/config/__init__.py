"""The configuration: schema (:mod:`.schema`), validation (:mod:`.validate`) and loading (:mod:`.loader`).

``load_config(path, overrides)`` or ``as_config(anything)`` gives a validated, read-only
:class:`TrainConfig`; each component of the engine receives its own section (``cfg.snapshot``,
``cfg.detect``...). No torch: ``import safetrain.config`` stays light.
"""

from __future__ import annotations

from .loader import ConfigLike, as_config, load_config
from .schema import (
    AmpConfig,
    ClipConfig,
    DetectConfig,
    DivergenceConfig,
    GuardConfig,
    LogConfig,
    RecoveryConfig,
    ReplayConfig,
    SanitizeAction,
    SanitizeConfig,
    SnapshotConfig,
    SpikeConfig,
    TrainConfig,
    iter_fields,
    to_dict,
    to_yaml,
    without_replays,
)
from .validate import validate

__all__ = [
    "TrainConfig",
    "DetectConfig",
    "ReplayConfig",
    "SanitizeConfig",
    "SpikeConfig",
    "DivergenceConfig",
    "ClipConfig",
    "GuardConfig",
    "AmpConfig",
    "RecoveryConfig",
    "SnapshotConfig",
    "LogConfig",
    "SanitizeAction",
    "ConfigLike",
    "load_config",
    "as_config",
    "validate",
    "to_dict",
    "to_yaml",
    "iter_fields",
    "without_replays",
]
