"""Quarantine of bad samples: a sampler that skips them, and ``quarantine.json`` that remembers them.

The cost is a deque of the indices in flight; when the ranks step together (the guard's sync is a
:class:`~safetrain.distributed.DistributedSync`), one collective on a step that carries a
diagnosis. Part of :mod:`safetrain.diagnose`; ``fit`` drives :class:`QuarantineKeeper`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sized, Tuple, Union

import torch
from torch.utils.data import DataLoader, Sampler

from .. import distributed
from ..errors import SafetrainError
from ..rundir import atomic_write_text
from ..rundir.safefile import read_own

__all__ = ["QuarantineSampler", "QuarantineKeeper", "read_quarantine", "write_quarantine"]

logger = logging.getLogger(__name__)


class QuarantineSampler(Sampler[int]):
    """Wrap a sampler of dataset indices: skip quarantined ones, remember the order the rest went out.

    When a replay isolates the rows that make the loss non-finite, ``fit`` maps them to dataset
    indices through :class:`QuarantineSampler` (which records, in order, the indices it handed to the
    ``DataLoader``), writes them to ``<log.dir>/quarantine.json`` (atomically) and the sampler skips
    them in later epochs and after a resume. Users of Lightning, Levanter and Megatron get at best a
    batch index to skip by hand.

    In one process a quarantined index is simply left out (the epoch is shorter). Under
    torch.distributed every rank must run the same number of batches or the first collective
    after the shortest epoch waits for ever, so there each quarantined index of this rank's shard
    is replaced by a repeat of one of the shard's healthy ones (as ``DistributedSampler`` pads
    its shards); the set of quarantined indices is the same on every rank (see
    :class:`QuarantineKeeper`) and takes effect from the next epoch.

    Args:
        sampler: the sampler to wrap (``RandomSampler``, ``SequentialSampler``, ``DistributedSampler``...).
        quarantined: dataset indices to skip from the start.
        keep_length: replace instead of skip; ``None``: when the ranks step together, as the guard's
            sync says (:meth:`follow`), or, before a :class:`QuarantineKeeper` has told it, when
            torch.distributed runs more than one rank.

    Example::

        sampler = QuarantineSampler(torch.utils.data.RandomSampler(dataset))
        loader = DataLoader(dataset, batch_size=64, sampler=sampler)
        SafeTrainer(model, opt, cfg, loss_fn=loss_fn).fit(loader, epochs=3)   # bad samples skipped from then on
    """

    def __init__(
        self, sampler: Iterable[int], quarantined: Iterable[int] = (), keep_length: Optional[bool] = None
    ) -> None:
        self.sampler = sampler
        self.quarantined = set(int(i) for i in quarantined)
        self.keep_length = keep_length
        self.skipped = 0  # quarantined indices passed over, over the sampler's life
        self.repeated = 0  # healthy indices handed out twice in their place (keep_length only)
        self._issued: deque = deque()
        self._sync: Any = None  # the guard's sync, once a keeper has told it (keep_length=None)

    def follow(self, sync: Any) -> None:
        """Keep the epoch's length (``keep_length=None``) exactly when ``sync``'s ranks step together
        (not ``sync.steps_alone``): a plain model in a process group skips, as in one process."""
        self._sync = sync

    def __iter__(self) -> Iterator[int]:
        self._issued.clear()
        keep_length = self.keep_length
        if keep_length is None:
            keep_length = not self._sync.steps_alone if self._sync is not None else distributed.active()
        if keep_length:
            yield from self._same_length()
            return
        for index in self.sampler:
            if int(index) in self.quarantined:
                self.skipped += 1
                continue
            self._issued.append(int(index))
            yield index

    def _same_length(self) -> Iterator[int]:
        quarantined = set(self.quarantined)  # as at the start of the epoch, on every rank alike
        shard = [int(i) for i in self.sampler]
        kept = [i for i in shard if i not in quarantined]
        if shard and not kept:
            raise SafetrainError(
                f"every one of this rank's {len(shard)} samples is quarantined: nothing left to train on"
            )
        missing = len(shard) - len(kept)
        self.skipped += missing
        self.repeated += missing
        for index in kept + [kept[j % len(kept)] for j in range(missing)]:
            self._issued.append(index)
            yield index

    def __len__(self) -> int:
        return len(self.sampler) if isinstance(self.sampler, Sized) else 0

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to a ``DistributedSampler``-like inner sampler."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def take(self, n: int) -> List[int]:
        """The next ``n`` dataset indices handed out (fewer at the end of the epoch), in order.

        Call it with the number of indices the loader's batch sampler takes per batch (its
        ``batch_size``), not with a batch's row count: a ``collate_fn`` that drops a sample makes
        a batch shorter than its indices (see :meth:`QuarantineKeeper.indices_for`).
        """
        return [self._issued.popleft() for _ in range(min(n, len(self._issued)))]

    def add(self, indices: Iterable[int]) -> List[int]:
        """Quarantine more indices; returns those that were new."""
        new = sorted(set(int(i) for i in indices) - self.quarantined)
        self.quarantined.update(new)
        return new


def read_quarantine(path: Union[str, os.PathLike]) -> List[int]:
    """The dataset indices in a ``quarantine.json`` (an empty list when the file does not exist).

    Raises:
        SafetrainError: the file is not a quarantine file (names the file and what is wrong).
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = json.loads(read_own(path).decode("utf-8"))  # never through a link out of the run directory
        return [int(i) for i in data["indices"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SafetrainError(f'{path}: not a quarantine file ({exc}); expected {{"indices": [int, ...]}}') from None


def write_quarantine(
    path: Union[str, os.PathLike], indices: Iterable[int], detail: Optional[Dict[str, Any]] = None
) -> None:
    """Write ``{"indices": [...], ...detail}`` atomically (temp file, fsync, rename, fsync the directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"indices": sorted(set(int(i) for i in indices)), **(detail or {})}
    atomic_write_text(path, json.dumps(payload, indent=1), prefix=".tmp-quarantine-")


class QuarantineKeeper:
    """``fit``'s side of the quarantine: batch indices in, isolated samples out to file and journal.

    A batch takes ``batch_size`` indices from the sampler (fewer at the end of an epoch), the way
    the ``DataLoader``'s batch sampler grouped them, so a batch that a ``collate_fn`` made shorter
    (or longer) leaves the next batches' mapping intact. Such a batch's own rows cannot be told
    apart: its mapping is refused (``None``), the first one is journaled (action ``unmapped``), and
    a replay that isolates rows in it names no dataset sample (action ``refused``, saying why)
    rather than a healthy neighbour. A ``collate_fn`` that swaps samples while keeping the row
    count cannot be seen; without ``batch_size`` each batch takes as many indices as it has rows.

    Args:
        sampler: the loader's :class:`QuarantineSampler` (``None``: a no-op keeper).
        run_dir: where ``quarantine.json`` lives (``None``: in memory only); it is read at start.
        emit: ``emit(action, message, detail, at=None)`` journals a ``Quarantined`` event (``at``:
            the ``(epoch, batch index)`` of the batch it is about; ``None``: the step's).
        batch_size: the indices the loader takes from the sampler per batch (``DataLoader.batch_size``);
            ``None``: not known.
        sync: the guard's sync (:func:`safetrain.distributed.make_sync`): the rank that writes the
            file, and whether the ranks step together (then they unite what they isolated, and the
            sampler keeps its epochs' length). ``None``: the process's default group, as if every
            rank trained one DDP model (:func:`safetrain.distributed.make_sync` without a model).
    """

    def __init__(
        self,
        sampler: Any,
        run_dir: Optional[Path],
        emit: Any,
        batch_size: Optional[int] = None,
        sync: Any = None,
    ) -> None:
        self.sampler = sampler if isinstance(sampler, QuarantineSampler) else None
        self.sync = sync if sync is not None else distributed.make_sync(torch.device("cpu"))
        if self.sampler is not None:
            self.sampler.follow(self.sync)
        self.path = run_dir / "quarantine.json" if run_dir is not None else None
        self.emit = emit
        self.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        self.unmapped = 0  # batches whose rows could not be mapped to dataset indices
        self._whole = False  # each batch is one dataset sample (a DataLoader without batching)
        self._step_unmapped: Optional[Dict[str, int]] = None  # the last such batch of the step being fed
        self._skipped_seen = self._repeated_seen = 0
        if self.sampler is not None and self.path is not None:
            known = self.sampler.add(read_quarantine(self.path))
            if known:
                emit("load", f"{len(known)} quarantined samples from {self.path} will be skipped", {"indices": known})

    @classmethod
    def for_loader(cls, loader: Any, run_dir: Optional[Path], emit: Any, sync: Any = None) -> "QuarantineKeeper":
        """The keeper of a loader: its ``sampler`` (a no-op keeper unless a :class:`QuarantineSampler`)
        and its ``batch_size`` (a ``DataLoader``'s; ``None`` for another iterable). A ``DataLoader``
        without batching (``batch_size=None``) takes one index per batch: every row is that sample's.
        ``sync``: the guard's sync (see the class)."""
        size = getattr(loader, "batch_size", None)
        keeper = cls(getattr(loader, "sampler", None), run_dir, emit, size, sync=sync)
        keeper._whole = isinstance(loader, DataLoader) and loader.batch_sampler is None
        return keeper

    def indices_for(self, batch: Any, at: Optional[Tuple[int, int]] = None) -> Optional[List[int]]:
        """The dataset indices of ``batch``'s rows, or ``None`` when they are not known (``at``: the
        batch's ``(epoch, batch index)``, for the event that says so).

        ``None`` too when the batch's row count differs from the indices the sampler gave for it
        (a ``collate_fn`` dropped or added samples): which row is which sample is then ambiguous.
        """
        if self.sampler is None:
            return None
        from ..detect import iter_tensors

        rows = next((t.shape[0] for _, t in iter_tensors(batch) if t.dim() > 0), 0)
        if self._whole:
            return self.sampler.take(1) * rows or None
        indices = self.sampler.take(self.batch_size if self.batch_size is not None else rows)
        if len(indices) == rows:
            return indices
        self.unmapped += 1
        self._step_unmapped = {"rows": rows, "indices": len(indices)}
        if self.unmapped == 1:
            self.emit(
                "unmapped",
                f"a batch of {rows} rows came from {len(indices)} dataset indices (a collate_fn that drops or "
                "adds samples?): its rows cannot be matched to dataset samples, so a bad sample in such a batch "
                "is not quarantined (later batches are mapped as usual)",
                dict(self._step_unmapped),
                at=at,
            )
        return None

    def after_step(self, events: Iterable[Any]) -> None:
        """Quarantine the dataset indices a replay isolated in this step's events.

        When the ranks step together (the sync's ``steps_alone`` is false) their indices are united
        with one collective, on the steps that carry a diagnosis only: the guard takes such
        decisions on every rank together, so every rank makes the call and no healthy step pays
        for it. Rank 0 writes the file.
        """
        if self.sampler is None:
            return
        unmapped, self._step_unmapped = self._step_unmapped, None
        diagnosed = [
            event.detail.get("diagnosis")
            for event in events
            if event.name == "anomaly" and isinstance(event.detail.get("diagnosis"), dict)
        ]
        if not diagnosed:
            return
        indices = [i for d in diagnosed for i in d.get("dataset_indices") or ()]
        # the micro-batch the replay pinned the rows on (under accumulation, not the step's last batch)
        at = next(((e.epoch, e.batch) for e in events if e.name == "anomaly" and "diagnosis" in e.detail), None)
        if unmapped is not None:
            self._refused(diagnosed, unmapped, at)
        together = not self.sync.steps_alone
        if together:
            indices = sorted({int(i) for part in self.sync.gather_object(indices) for i in part})
        new = self.sampler.add(indices)
        if new:
            if self.path is not None and self.sync.rank == 0:
                write_quarantine(self.path, self.sampler.quarantined)
            kept = ", replaced by repeats to keep the ranks in step" if together else ""
            when = "from the next epoch on" + kept
            self.emit(
                "add",
                f"quarantined dataset samples {new}: skipped {when}",
                {"indices": new, "file": str(self.path) if self.path else None},
                at=at,
            )

    def _refused(self, diagnosed: List[Dict[str, Any]], unmapped: Dict[str, int], at: Any = None) -> None:
        """Journal rows a replay isolated in a batch whose rows could not be mapped to samples."""
        rows = sorted({int(r) for d in diagnosed if not d.get("dataset_indices") for r in d.get("bad_rows") or ()})
        if rows:
            self.emit(
                "refused",
                f"bad rows {rows} not quarantined: their batch had {unmapped['rows']} rows but the sampler gave "
                f"{unmapped['indices']} dataset indices for it (a collate_fn that drops or adds samples?), so which "
                "samples they are is ambiguous; none is named rather than a healthy one",
                {"bad_rows": rows, **unmapped},
                at=at,
            )

    def end_epoch(self) -> None:
        """Journal how many quarantined samples the epoch passed over."""
        if self.sampler is None:
            return
        skipped, self._skipped_seen = self.sampler.skipped - self._skipped_seen, self.sampler.skipped
        if skipped:
            repeated, self._repeated_seen = self.sampler.repeated - self._repeated_seen, self.sampler.repeated
            also = f" ({repeated} healthy samples repeated in their place)" if repeated else ""
            self.emit(
                "skip",
                f"skipped {skipped} quarantined samples this epoch{also}",
                {"skipped": skipped, "repeated": repeated, "quarantined": sorted(self.sampler.quarantined)},
            )
