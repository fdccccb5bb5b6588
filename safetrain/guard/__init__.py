"""The guard: one training step's protocol, usable from any loop (``from safetrain import Guard``).

``machine`` (the step's states, the table of their moves, the facts of the step under way),
``protocol`` (the step: four verbs, and ``Guard.step`` built from them), ``parts`` (what a guard
is made of, and the run-level calls its drivers make), ``decisions`` (the decision loop),
``judge`` (a read -> its anomaly), ``recovery`` (carries out decisions), ``forward`` (one
micro-batch through the model), ``plumbing`` (device, autocast, scaler, gradients), ``state``
(what recovery remembers).
"""

from ..steps import StepResult
from .machine import Phase
from .protocol import Guard
from .state import RecoveryState

__all__ = ["Guard", "StepResult", "Phase", "RecoveryState"]
