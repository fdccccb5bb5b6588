"""Detectors: turn a training step into device-side flags, read once, explained only on a trip.

Cost: a few device ops per step and no host sync until :meth:`StepFlags.read`, the step's one host
read (:class:`StepFlags` shows how the guard composes the healthy step around it). Only when
``read.tripped()`` is not empty does the guard go to the host for the detail: :func:`describe_rows`,
:func:`drop_rows`, :func:`batch_error`, :meth:`ActivationMonitor.locate`, :meth:`GradCheck.finding`,
:meth:`WeightCheck.finding`; each returns a frozen, JSON-ready finding. Used by ``guard`` and
``diagnose``; detectors only (test helpers live in :mod:`safetrain.testing`).
"""

from __future__ import annotations

from .activations import ActivationMonitor
from .batch_scan import TARGET_KEYS, BatchScan, scan_batch
from .exact import ExactTrace, exact_hooks
from .findings import (
    Finding,
    GradFinding,
    LossFinding,
    ModuleFinding,
    RowFinding,
    TensorStats,
    WeightFinding,
    tensor_stats,
)
from .flags import FLAG_KINDS, StepFlags, StepRead
from .grads import GradCheck, GradNorms, WeightCheck, fused_norms
from .hooks import HookHandle, floating_tensors
from .norms import HUGE_NORM, true_norm, true_norms
from .rows import batch_error, describe_rows, drop_rows, rows_to_drop
from .walk import iter_tensors

__all__ = [
    "TARGET_KEYS",
    "BatchScan",
    "scan_batch",
    "describe_rows",
    "drop_rows",
    "batch_error",
    "rows_to_drop",
    "iter_tensors",
    "ActivationMonitor",
    "HookHandle",
    "ExactTrace",
    "exact_hooks",
    "floating_tensors",
    "GradCheck",
    "GradNorms",
    "WeightCheck",
    "fused_norms",
    "HUGE_NORM",
    "true_norm",
    "true_norms",
    "StepFlags",
    "StepRead",
    "FLAG_KINDS",
    "Finding",
    "RowFinding",
    "ModuleFinding",
    "LossFinding",
    "GradFinding",
    "WeightFinding",
    "TensorStats",
    "tensor_stats",
]
