"""safetrain: PyTorch training that survives numerical failure.

Detect NaN/Inf and loss spikes at the step, batch and layer where they start, explain them,
and recover under a policy set in YAML, at an overhead low enough to leave on.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import TYPE_CHECKING

from .config import TrainConfig, as_config, load_config
from .errors import (
    BatchError,
    ConfigError,
    SafetrainError,
    SnapshotError,
    TrainingAborted,
    TrainingInterrupted,
    TrainingKeyboardInterrupt,
)
from .numerics import (
    default_eps,
    masked_softmax,
    safe_acos,
    safe_asin,
    safe_div,
    safe_exp,
    safe_log,
    safe_logsumexp,
    safe_norm,
    safe_pow,
    safe_sqrt,
    sanitize,
    stable_log_softmax,
    stable_softmax,
)

if importlib.util.find_spec("fcntl") is None or not hasattr(os, "pwrite"):
    raise ImportError(
        "safetrain needs a POSIX system (Linux, macOS): its run-directory lock uses fcntl and its snapshot "
        "writer os.pwrite, which this Python lacks; on Windows, run it under WSL"
    )

if TYPE_CHECKING:  # what the lazy exports below are, for type checkers (imported on first use at run time)
    from .diagnose import Diagnosis
    from .diagnose.quarantine import QuarantineSampler
    from .guard import Guard, StepResult
    from .hooks import RunHook, StepRecord, TensorBoardHook
    from .run import FitResult
    from .trainer import SafeTrainer

__version__ = "0.1.0"

__all__ = [
    "SafeTrainer",
    "FitResult",
    "Guard",
    "StepResult",
    "QuarantineSampler",
    "Diagnosis",
    "RunHook",
    "StepRecord",
    "TensorBoardHook",
    "TrainConfig",
    "load_config",
    "as_config",
    "SafetrainError",
    "ConfigError",
    "BatchError",
    "SnapshotError",
    "TrainingAborted",
    "TrainingInterrupted",
    "TrainingKeyboardInterrupt",
    "default_eps",
    "safe_log",
    "safe_div",
    "safe_sqrt",
    "safe_exp",
    "safe_pow",
    "safe_norm",
    "safe_acos",
    "safe_asin",
    "stable_softmax",
    "stable_log_softmax",
    "masked_softmax",
    "safe_logsumexp",
    "sanitize",
]

logging.getLogger("safetrain").addHandler(logging.NullHandler())

# The engine is imported on first use, so that `import safetrain` (configs, numerics) stays light.
_LAZY = {
    "SafeTrainer": ".trainer",
    "FitResult": ".run",
    "Guard": ".guard",
    "StepResult": ".guard",
    "QuarantineSampler": ".diagnose.quarantine",
    "Diagnosis": ".diagnose",
    "RunHook": ".hooks",
    "StepRecord": ".hooks",
    "TensorBoardHook": ".hooks",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'safetrain' has no attribute {name!r}")
