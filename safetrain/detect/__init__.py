"""Detectors: turn a training step into device-side flags, read once, explained only on a trip.

The healthy step, as the guard composes it (no host sync until the read)::

    scan = scan_batch(batch, replace=...)          # inputs: row mask + flag, bad rows zero-filled
    monitor.reset()                                # eager mode: hooks attached once, records per step
    loss = loss_fn(model(scan.batch), ...)         # hooks fold each output into a 0-dim sum
    loss.backward()
    grads = grad_check.run()                       # one fused norm pass: per-param, total, flag
    flags.put("input", scan.flag); flags.put("loss", loss.detach()); flags.put("total_norm", grads.total_norm)
    flags.put("forward", monitor.values()); flags.put("weights", weight_check.maybe_run(step))
    read = flags.read()                            # host sync: the one per step
    if read.healthy: grad_check.clip_(max_norm, grads.total_norm); optimizer.step()

Only when ``read.tripped()`` is not empty does the guard go to the host for the detail:
:func:`describe_rows`, :func:`drop_rows`, :func:`batch_error`, :meth:`ActivationMonitor.locate`,
:meth:`GradCheck.finding`, :meth:`WeightCheck.finding`; each returns a frozen, JSON-ready finding.
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
