"""The step RNG bookkeeping: the RNG state each step starts from, kept for a replay's random draws.

A replay draws the same dropout masks as the step only if it starts from the step's RNG state.
The one cost on the healthy path is a host-side copy of the state at a step's start (no device
sync); :class:`StepRNG` stops copying while the model draws nothing. Owned by
:class:`safetrain.diagnose.Diagnoser`; read by both replays.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch

__all__ = ["StepRNG", "LOOK_EVERY", "RNG_MOVED"]

#: Steps between two comparisons of the RNG state with the kept one (see :meth:`StepRNG.begin_step`).
LOOK_EVERY = 50
#: A replay's note when the RNG state kept for the step may not be the step's.
RNG_MOVED = "random numbers were drawn since the RNG state was last kept: if the step drew any, the replay's differ"

#: The (CPU, CUDA per device) RNG states: host-side byte tensors.
RNGState = Tuple[torch.Tensor, List[torch.Tensor]]


def _same_rng(a: RNGState, b: RNGState) -> bool:
    """Two (CPU, CUDA) RNG states are equal (host-side byte tensors: no device sync)."""
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


class StepRNG:
    """Keeps the RNG state the current step starts from, as cheaply as the model allows.

    Args:
        enabled: ``detect.replay.enabled``; ``False`` makes :meth:`begin_step` a no-op.
        cuda: also keep the CUDA generators' states (a model with parameters on CUDA).

    Example::

        rng = StepRNG(enabled=True, cuda=False)
        rng.begin_step()              # at every step's start
        with rng.step_start():        # a replay: draws as the step did; the RNG is put back after
            ...
    """

    def __init__(self, enabled: bool, cuda: bool) -> None:
        self.enabled, self.cuda = bool(enabled), cuda
        #: The (CPU, CUDA) RNG states the current step started from: copied at its start, or, while
        #: the RNG is idle, at the last look (the same state unless something drew since, which
        #: :meth:`moved` tells); ``None`` with replays off. (An attribute: read at every update.)
        self.state: Optional[RNGState] = None
        self._idle = False  # no random number was drawn between the last two looks at the RNG
        self._since = 0  # steps since the last look
        self._look: Optional[RNGState] = None  # the state at the last look

    @property
    def idle(self) -> bool:
        """Whether the copy at every step has stopped: a whole window between two looks drew nothing."""
        return self._idle

    def begin_step(self) -> None:
        """Keep the RNG state this step starts from (a host-side copy, no device sync).

        A model that draws no random numbers (no dropout) leaves the state as it was, and any
        kept copy is then the step's: so every :data:`LOOK_EVERY` steps the state is compared
        with the one at the previous look; while a whole such window drew nothing, no copy is
        made until the next look (otherwise one every step). A replay checks again that the
        state is unchanged (:meth:`moved`), and says so when it is not (a model that began to
        draw random numbers since the last look, dropout switched on late, say).
        """
        if not self.enabled:
            return
        self._since += 1
        if self._since < LOOK_EVERY:
            if not self._idle:
                self.state = self._capture()
            return
        state = self._capture()
        self._idle = self._look is not None and _same_rng(state, self._look)
        self.state, self._look, self._since = state, state, 0

    def reset(self) -> None:
        """The RNG was set or drawn from outside the steps (a restore, an epoch's shuffle): copy
        it at every step again until a whole window between two looks finds it idle."""
        self._idle, self._since, self._look = False, 0, None

    def _capture(self) -> RNGState:
        return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if self.cuda else [])

    def moved(self) -> bool:
        """Whether the RNG was drawn from since the state kept for this step was taken, when it
        was not copied at the step's start: then the kept state may not be the step's, and a
        replay's random draws may differ from the step's. Copies resume at every step."""
        if not self._idle or self.state is None or _same_rng(self._capture(), self.state):
            return False
        self.reset()
        return True

    @contextlib.contextmanager
    def step_start(self) -> Iterator[None]:
        """Run the block from the step's starting RNG state; every RNG stream is put back afterwards."""
        devices = list(range(torch.cuda.device_count())) if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            if self.state is not None:
                torch.set_rng_state(self.state[0])
                if self.cuda:
                    torch.cuda.set_rng_state_all(self.state[1])
            yield
