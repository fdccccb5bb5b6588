"""The weight replay: which applied update made a weight non-finite, replayed from the newest snapshot.

Cost: a few Python references per applied update (no copy, no device work); the replay itself, on the
slow path only, runs up to ``detect.replay.keep_steps`` updates again. Part of ``diagnose``:
:class:`~safetrain.diagnose.Diagnoser` calls it for a ``weights`` fault and spends the budget.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..config import ReplayConfig
from ..detect import GradCheck, iter_tensors
from ..optimizers import needs_closure
from .diagnosis import Diagnosis
from .nonfinite import first_nonfinite_op, nonfinite_names
from .rng import RNG_MOVED

__all__ = ["WeightReplay", "describe_optimizer"]

logger = logging.getLogger(__name__)


#: Optimizer settings that say how an update is computed, not what it computes: left out of the line.
_HOW = frozenset({"foreach", "fused", "capturable", "differentiable", "initial_lr", "params"})


def describe_optimizer(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor] = ()) -> str:
    """The optimizer's class and the hyperparameters of the group holding the first of ``params``
    (else the first group): ``Adam(lr=0.001, betas=(0.9, 0.999), eps=0, weight_decay=0)``.

    Example::

        >>> describe_optimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5))
        'SGD(lr=0.5, momentum=0, dampening=0, weight_decay=0, nesterov=False, maximize=False)'
    """
    ids = {id(p) for p in params}
    groups = optimizer.param_groups
    group = next((g for g in groups if any(id(p) in ids for p in g["params"])), groups[0] if groups else {})

    def show(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, (float, int, tuple, list, torch.Tensor)):
            return repr(v)
        if isinstance(v, torch.Tensor):
            return show(v.item()) if v.numel() == 1 else f"tensor{tuple(v.shape)}"  # host sync: replay only
        if isinstance(v, (tuple, list)):
            return "(" + ", ".join(show(x) for x in v) + ")"
        return f"{v:g}"

    kept = [f"{k}={show(v)}" for k, v in group.items() if k not in _HOW and v is not None and not callable(v)]
    return f"{type(optimizer).__name__}({', '.join(kept)})"


class _Applied(NamedTuple):
    """One optimizer update as the guard applied it."""

    step: int
    micro: List[Any]
    lrs: List[Any]
    total: Optional[float]
    rng: Any
    clip: Optional[float] = None  # the norm the update was clipped to (None: not clipped)


class WeightReplay:
    """Keeps the updates applied since the newest snapshot and replays them when weights break.

    A ``weights`` fault (a parameter is NaN/Inf when a step starts) was made by an earlier optimizer
    update, or by code outside the training step (a bit flip, a user's in-place edit). Replaying the
    step that tripped cannot tell which. :class:`WeightReplay` keeps, for every update applied since
    the newest snapshot, references to its micro-batches, its learning rates, its total gradient
    norm and the RNG state it started from (a few Python references a step: no copy, no device
    work). When weights are found non-finite it

    1. copies the live (broken) state aside: model, optimizer, scheduler, scaler, RNGs, gradients;
    2. restores the newest snapshot into the live objects;
    3. runs the kept steps again (forward and backward under autocast and a loss scale, unscale,
       the ``zero_grads`` action where the step's gradients were not finite, the same clipping, the
       recorded learning rates, ``optimizer.step()`` under :class:`~.nonfinite.first_nonfinite_op`),
       checking the parameters after each;
    4. puts the live state back exactly, so the policy's action (``restore`` by default) proceeds as
       if there had been no replay.

    The :class:`~.diagnosis.Diagnosis` names the step whose update first made a weight non-finite,
    the parameters, the op and the optimizer with its hyperparameters (``Adam(lr=0.001, ...,
    eps=0, ...)``: with the user's line in its ``step`` for a hand-written optimizer); or, when every
    replayed step stays finite, says the weights were changed outside the training step. The budget
    is not spent here: :class:`~safetrain.diagnose.Diagnoser` spends it.

    Limits: when the ranks step together (``sync`` a :class:`~safetrain.distributed.DistributedSync`:
    DDP or FSDP2) the weight replay is skipped with a note (the ranks would have to replay
    together); a plain model in a process group replays on its own; with fp16 the replay's loss
    scale follows its own history from the snapshot (steps the GradScaler skipped are not kept);
    a step's data is replayed as the guard saw it, so a loader that reuses its batch tensors in
    place makes the replay see later data.

    Args:
        state: the guard's :class:`~safetrain.snapshot.TrainState` (model, optimizer, scheduler,
            scaler, RNGs): what a snapshot restores and what is put back afterwards.
        params: the ``(name, parameter)`` pairs that train.
        cfg: the ``detect.replay`` section (``enabled``, ``keep_steps``, ``keep_mb``, ``time_limit_s``).
        loss_of: ``loss_of(batch) -> loss``: the guard's forward and loss for one micro-batch.
        autocast: a zero-argument callable returning the step's autocast context.
        prepare: ``prepare(batch) -> batch``: the sanitizer's device-side cleaning, as the
            step's forward saw it.
        accumulate: ``guard.accumulate_steps`` (each micro-batch's loss is divided by it).
        clip: ``guard.clip_grad_norm``.
        sync: the guard's sync (:func:`safetrain.distributed.make_sync`): asked whether this rank
            steps alone (``steps_alone``), never the process.

    Example::

        weights = WeightReplay(guard.state, guard.params, cfg.detect.replay, loss_of=loss_of,
                               autocast=contextlib.nullcontext, prepare=lambda b: b, sync=LocalSync())
        weights.clear(step=0)                          # a snapshot of step 0 was taken
        weights.record(1, [batch], total=0.5, rng=None)  # before optimizer.step() of step 1
        if not weights.why_not(store):                 # when a weight is found non-finite
            diagnosis = weights.replay(store)
    """

    def __init__(
        self,
        state: Any,
        params: Sequence[Tuple[str, torch.nn.Parameter]],
        cfg: ReplayConfig,
        *,
        loss_of: Callable[[Any], torch.Tensor],
        autocast: Callable[[], Any],
        prepare: Callable[[Any], Any],
        accumulate: int = 1,
        clip: Optional[float] = None,
        sync: Any,
    ) -> None:
        self.state, self.params, self.cfg, self.sync = state, list(params), cfg, sync
        self.loss_of, self.autocast = loss_of, autocast
        self.prepare, self.accumulate, self.clip = prepare, accumulate, clip
        self._clipper = GradCheck(self.params)
        self.keep = int(cfg.keep_steps) if cfg.enabled else 0
        self.never = ""  # why this run's updates are never replayed (named steps), else ""
        self._steps: List[_Applied] = []
        self._applied = 0  # updates since the base snapshot, kept or not
        self._base: Optional[int] = None  # the step of the newest snapshot, once one is known
        self.budget = float(cfg.keep_mb) * 2**20  # bytes of kept batches, at most
        self._bytes, self._over_budget = 0, False

    @property
    def kept(self) -> int:
        """How many applied updates are kept for a replay now."""
        return len(self._steps)

    def record(self, step: int, micro: List[Any], total: Optional[float], rng: Any, clip: Any = ...) -> None:
        """Keep a reference to an update about to be applied (call just before ``optimizer.step()``).

        Args:
            step: the guard's step number.
            micro: the micro-batches whose gradients this update uses.
            total: the total gradient norm clipping uses (``None``: the gradients were used as
                they were, non-finite ones included, as under the ``warn`` action).
            rng: the RNG state the step started from (:attr:`~.rng.StepRNG.state`).
            clip: the norm the update was clipped to (``None``: not clipped; by default ``self.clip``).
        """
        if self.keep == 0:
            return
        self._applied += 1
        if self._applied <= self.keep and not self._over_budget:
            self._bytes += sum([t.nbytes for b in micro for _, t in iter_tensors(b)])  # (no call per tensor)
            if self._bytes <= self.budget:
                lrs = [g["lr"] for g in self.state.optimizer.param_groups]
                self._steps.append(_Applied(step, micro, lrs, total, rng, self.clip if clip is ... else clip))
                return
            self._over_budget = True
        if self._steps:
            self._steps = []  # too many to replay: let go of the batches

    def clear(self, step: int) -> None:
        """A snapshot of ``step`` was taken or restored: the next updates start from it."""
        self._steps, self._applied, self._base = [], 0, step
        self._bytes, self._over_budget = 0, False

    def not_replayed(self, why: str) -> Diagnosis:
        """The ``weights`` diagnosis without a replay: the non-finite parameters and ``why`` (from
        :meth:`why_not`) as its note."""
        started = time.perf_counter()
        broken = nonfinite_names(self.params)
        logger.info("weight replay skipped: %s", why)
        return Diagnosis(
            reproducible=True, kind="weights", nonfinite_weights=broken, note=why, seconds=time.perf_counter() - started
        )

    def replay(self, store: Any, rng_moved: bool = False) -> Diagnosis:
        """Explain non-finite weights by replaying the kept updates from the newest snapshot.

        Training is left exactly as it was: parameters, buffers, optimizer, scheduler and scaler
        state, gradients, the model's mode and every RNG stream. Call it only when
        :meth:`why_not` says nothing; the caller spends the budget.

        Args:
            store: the guard's snapshot store; its newest snapshot must be the one the kept
                updates follow (the guard calls :meth:`clear` on every snapshot and restore).
            rng_moved: the RNG was drawn from since the kept state was taken
                (:meth:`~.rng.StepRNG.moved`): the note says the replay's draws may differ.

        Returns:
            A :class:`~.diagnosis.Diagnosis` of kind ``"weights"``.
        """
        started = time.perf_counter()
        broken = nonfinite_names(self.params)
        try:
            live = self._set_aside()
        except Exception as exc:  # state that cannot be captured: nothing was touched yet
            return Diagnosis(
                reproducible=True,
                kind="weights",
                nonfinite_weights=broken,
                note=f"weight replay not possible: {type(exc).__name__}: {exc}",
                seconds=time.perf_counter() - started,
            )
        try:
            store.restore(self.state)
            found = self._run(started + self.cfg.time_limit_s, live[0])
        except Exception as exc:  # diagnosis only: training goes on with the policy's action
            logger.warning("weight replay failed: %s: %s", type(exc).__name__, exc)
            found = {
                "reproducible": True,
                "nonfinite_weights": broken,
                "note": f"weight replay failed: {type(exc).__name__}: {exc}",
            }
        finally:
            self._put_back(live)
        found.setdefault("nonfinite_weights", broken)
        if rng_moved:
            found["note"] = f"{found['note']}; {RNG_MOVED}" if found.get("note") else RNG_MOVED
        diagnosis = Diagnosis(kind="weights", seconds=time.perf_counter() - started, **found)
        logger.info("weight replay: %s", diagnosis.describe())
        return diagnosis

    def why_not(self, store: Any) -> str:
        """Why the kept updates cannot be replayed from ``store``'s newest snapshot (``""``: they can)."""
        if self.keep == 0:
            return "detect.replay.keep_steps=0: the updates since the snapshot are not kept"
        if self.never:
            return self.never
        if needs_closure(self.state.optimizer):
            return f"{type(self.state.optimizer).__name__}.step needs a closure: its updates are not replayed"
        if not self.sync.steps_alone:
            return "not replayed under torch.distributed (every rank would have to replay together)"
        if self._base is None or len(store) == 0:
            return "no snapshot to replay from"
        if self._over_budget:
            return (
                f"the batches of the updates since the newest snapshot (step {self._base}) exceed "
                f"detect.replay.keep_mb={self.cfg.keep_mb:g}: not kept, not replayed"
            )
        if self._applied > len(self._steps):
            return (
                f"the newest snapshot (step {self._base}) is {self._applied} updates old, more than "
                f"detect.replay.keep_steps={self.keep}: not replayed"
            )
        return ""

    def _set_aside(self) -> Tuple[Any, ...]:
        """Copy the live state to the host (with each tensor's home device) and keep the gradients."""
        captured = self.state.capture({"step": 0})
        homes = {n: t.device for n, t in captured.tensors.items()}
        tensors = {n: t.to("cpu", copy=True) for n, t in captured.tensors.items()}
        params = list(self.state.model.parameters())
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        return tensors, copy.deepcopy(captured.meta), homes, params, grads, self.state.model.training

    def _put_back(self, live: Tuple[Any, ...]) -> None:
        tensors, meta, homes, params, grads, training = live
        self.state.apply(tensors, meta, owned=False, where="the live state before the weight replay", homes=homes)
        for p, g in zip(params, grads):
            p.grad = g
        self.state.model.train(training)

    def _run(self, deadline: float, live: Dict[str, torch.Tensor]) -> Dict[str, Any]:
        """Run the kept updates from the restored snapshot; stop at the first that breaks a weight.
        ``live``: the live state's tensors, to name the parameters the replay does not reproduce."""
        optimizer = self.state.optimizer
        scaler = self._scaler()
        for done, applied in enumerate(self._steps):
            if time.perf_counter() > deadline:
                return {
                    "reproducible": True,
                    "note": f"stopped after {done} of {len(self._steps)} updates at "
                    f"detect.replay.time_limit_s={self.cfg.time_limit_s}",
                }
            bad_grads = self._gradients(applied, scaler)
            with first_nonfinite_op() as mode:
                optimizer.step()
            if scaler is not None:
                scaler.update()
            broken = nonfinite_names(self.params)
            if broken:
                culprit = mode.culprit([p for n, p in self.params if n in broken])
                line = describe_optimizer(optimizer, [p for n, p in self.params if n in broken])
                return {
                    "reproducible": True,
                    "weights_step": applied.step,
                    "nonfinite_weights": broken,
                    "op": culprit.op if culprit else None,
                    "op_line": f"{line} at {culprit.line}" if culprit and culprit.inside else line,
                    "nonfinite_grads": bad_grads,
                    "note": f"replayed {done + 1} update(s) from the snapshot of step {self._base}",
                }
        differ = [n for n, p in self.params if not torch.equal(p.detach().cpu(), live.get(f"model/{n}", p.cpu()))]
        return {
            "reproducible": False,
            "note": f"weights were changed outside the training step: the "
            f"{len(self._steps)} update(s) replayed from the snapshot of step {self._base} stayed finite; "
            f"live parameters that differ from the replay: {', '.join(differ) or 'none'}",
        }

    def _gradients(self, applied: _Applied, scaler: Optional[torch.amp.GradScaler]) -> Tuple[str, ...]:
        """One update's gradients as the guard made them: scaled, unscaled, zeroed, clipped; the LRs set."""
        optimizer = self.state.optimizer
        if applied.rng is not None:
            torch.set_rng_state(applied.rng[0])
            if applied.rng[1]:
                torch.cuda.set_rng_state_all(applied.rng[1])
        optimizer.zero_grad(set_to_none=True)
        for batch in applied.micro:
            with self.autocast():
                loss = self.loss_of(self.prepare(batch))
            scaled = loss / self.accumulate if self.accumulate > 1 else loss
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        with_grad = [(n, p.grad) for n, p in self.params if p.grad is not None]
        bad = nonfinite_names(with_grad)
        if bad and applied.total is not None:  # the guard stepped on finite gradients: zero_grads zeroed these
            for n, g in with_grad:
                if n in bad:
                    g.zero_()
        if applied.clip is not None and applied.total is not None and math.isfinite(applied.total):
            self._clipper.clip_(applied.clip, applied.total)  # as the guard clipped, with the step's norm
        for group, lr in zip(optimizer.param_groups, applied.lrs):
            group["lr"] = lr
        return bad

    def _scaler(self) -> Optional[torch.amp.GradScaler]:
        """A private GradScaler with the restored scaler's state: the live one's per-step state is left alone."""
        live = self.state.scaler
        if live is None or not live.is_enabled():
            return None
        device = next((p.device.type for _, p in self.params), "cpu")
        scaler = torch.amp.GradScaler(device)
        scaler.load_state_dict(live.state_dict())
        return scaler
