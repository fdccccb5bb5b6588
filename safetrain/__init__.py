"""safetrain: PyTorch training that survives numerical failure.

Detect NaN/Inf and loss spikes at the step, batch and layer where they start, explain them,
and recover under a policy set in YAML, at an overhead low enough to leave on.
"""

from __future__ import annotations

import logging

from .config import TrainConfig, as_config, load_config
from .errors import BatchError, ConfigError, SafetrainError, SnapshotError, TrainingAborted

__version__ = "0.1.0"

__all__ = [
    "TrainConfig",
    "load_config",
    "as_config",
    "SafetrainError",
    "ConfigError",
    "BatchError",
    "SnapshotError",
    "TrainingAborted",
]

logging.getLogger("safetrain").addHandler(logging.NullHandler())
