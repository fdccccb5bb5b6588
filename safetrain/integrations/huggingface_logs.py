"""What the Hugging Face ``Trainer``'s logs show of a guarded run: :class:`TrainerLogs`.

The Trainer logs (``on_log``: its reporters, W&B, TensorBoard, ``log_history``) what it computed
itself, which a guarded run contradicts in three places; :class:`TrainerLogs` puts them right:

* ``learning_rate`` is the schedule's (``lr_scheduler.get_last_lr()``): under an LR backoff the
  optimizer used less. Logged: the LR in force at the step's update (the schedule's is
  ``learning_rate / lr_scale``).
* ``loss`` averages every step in the logging window, a skipped one included: a NaN loss the
  Trainer's ``logging_nan_inf_filter`` turns into a copy of the running sum (``0.0`` when the
  window holds the skipped step only), a spike's loss as it was. Logged: the mean of the window's
  applied steps (the guard's loss, the mean over ranks and micro-batches, as the Trainer's), and
  no ``loss`` when no step of the window was applied. The Trainer's final ``train_loss`` (its
  ``TrainOutput``) still counts the skipped steps: it is computed outside any callback.
* ``grad_norm`` is the norm the Trainer's clipping measured: NaN on a step the guard skipped for
  a non-finite gradient. Logged: the guard's read, before any clipping.

The guard's own figures (``safetrain/...``, the Lightning callback's keys) are added beside them
by the callback, from :func:`safetrain.metrics.step_metrics`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

__all__ = ["TrainerLogs"]


class TrainerLogs:
    """The guard's view of the steps since the Trainer's last log, and the values it logs."""

    def __init__(self) -> None:
        self._window: List[Tuple[bool, float]] = []  # (applied, loss) of each step since the last log
        self.lr: Optional[float] = None  # the LR in force at the last step's update

    def step(self, trained: bool, loss: float, lr: Optional[float]) -> None:
        """A decided step: whether its update was applied, its loss, the LR it was applied with."""
        self._window.append((trained, loss))
        if lr is not None:
            self.lr = lr

    def fill(self, logs: Dict[str, Any], guard: Any) -> Dict[str, Any]:
        """Put the guard's figures into a training log (one with ``loss``); returns what changed
        (``loss`` mapped to ``None`` when it was taken out)."""
        out: Dict[str, Any] = {"grad_norm": guard.last_grad_norm}
        if self.lr is not None:
            out["learning_rate"] = self.lr
        window, self._window = self._window, []
        applied = [loss for trained, loss in window if trained]
        if len(applied) < len(window):  # a step the guard did not apply: its loss is not the model's
            out["loss"] = sum(applied) / len(applied) if applied else None
        for key, value in out.items():
            if value is None:
                logs.pop(key, None)
            else:
                logs[key] = value
        return out
