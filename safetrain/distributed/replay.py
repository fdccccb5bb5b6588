"""The step replay under a process group: run locally (no DDP collective) and agreed on
whether the fault reproduces, so every rank takes the same decision."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from .group import local

if TYPE_CHECKING:
    from .sync import DistributedSync

__all__ = ["AgreedReplay", "wrap_replayer"]

#: What a replay says of where a fault went non-finite: shared by the rank it reproduced on.
_ORIGIN = ("module", "module_type", "call_index", "op", "op_line", "op_caller")


def wrap_replayer(replayer: Any, sync: Any, model: torch.nn.Module) -> Any:
    """The guard's step replayer for ``sync``: as it is when the rank steps alone
    (:class:`~.sync.LocalSync`), else an :class:`AgreedReplay` (run without DDP collectives,
    agreed on ``reproducible`` across ranks).

    Example::

        diagnoser.wrap_step_replay(lambda replay: wrap_replayer(replay, guard_sync, model))
    """
    return replayer if sync.steps_alone else AgreedReplay(replayer, sync, model)


class AgreedReplay:
    """The guard's replayer, run under :func:`local` and agreed on ``reproducible`` across ranks.

    A rank whose own data was clean replays a finite step: on its own it would call the fault
    transient and retry while the others take the ladder. Here the fault is reproducible if it
    reproduced on any rank, and a ``weights`` fault if some rank's parameters were non-finite
    before the step; an error in some rank's replay is raised on every rank.
    """

    def __init__(self, inner: Any, sync: "DistributedSync", model: torch.nn.Module) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_sync", sync)
        object.__setattr__(self, "_model", model)

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def replay(self, *args: Any, **kwargs: Any) -> Any:
        """Replay locally, then agree: reproducible if it reproduced on some rank, a ``weights``
        fault if some rank's parameters were non-finite before the step."""
        diagnosis, error = None, None
        try:
            with local(self._model):
                diagnosis = self._inner.replay(*args, **kwargs)
        except Exception as exc:  # re-raised below, after every rank has voted
            error = exc
        vote = 4 if error is not None else int(bool(diagnosis.reproducible)) | (2 if diagnosis.kind == "weights" else 0)
        votes = self._sync.gather_int(vote)
        if error is not None:
            raise error
        if 4 in votes:
            raise RuntimeError(
                f"the replay failed on rank(s) {[r for r, v in enumerate(votes) if v == 4]}; see their log"
            )
        # Where the fault went non-finite, from the first rank it reproduced on: every rank's journal
        # names the layer of a fault in another rank's data (every rank gathers: the votes are shared).
        reproduced = [r for r, v in enumerate(votes) if v & 1]
        mine = {f: getattr(diagnosis, f) for f in _ORIGIN} if diagnosis is not None and diagnosis.reproducible else None
        origins = self._sync.gather_object(mine) if reproduced else []
        if any(v & 2 for v in votes) and diagnosis.kind != "weights":
            diagnosis = dataclasses.replace(
                diagnosis,
                reproducible=True,
                kind="weights",
                note=f"non-finite parameters on rank(s) {[r for r, v in enumerate(votes) if v & 2]}",
            )
        elif any(votes) and not diagnosis.reproducible:
            first = (origins[reproduced[0]] if reproduced else None) or {}
            note = f"reproduced on rank(s) {[r for r, v in enumerate(votes) if v]}"
            diagnosis = dataclasses.replace(diagnosis, reproducible=True, note=note, **first)
        return diagnosis
