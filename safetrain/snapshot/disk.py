"""``SafetensorsStore``: one safetensors file per snapshot, written atomically, verified on load.

Files are ``snapshot-{step:010d}.safetensors`` so that names sort by step. A save writes
``.tmp-snapshot-...`` in the same directory, fsyncs it, renames it over the final name and
fsyncs the directory: a crash at any moment leaves either the previous set of snapshots or
the new one, never a half-written file under a snapshot's name. Temporary files are never
listed. After a save, this run's snapshots newer than it (left over from a trajectory that was
rolled back) and all but its newest ``keep`` are renamed out of the listing at once and unlinked
by a worker thread (``close()`` waits for it). Loading reads into fresh memory (no mmap), so
deleted files really free their space.

A directory may hold snapshots of several runs (each file's metadata names its ``run_id``): a
store restores, rotates and deletes only its own run's, and a fresh run refuses a directory
holding another run's (:meth:`SafetensorsStore.check_fresh`). One process writes a directory at
a time: the first write takes the directory's lock (:class:`safetrain.rundir.dirlock.DirLock`, the run
directory's too; held until ``close()``, a second writer gets a ``SnapshotError`` naming the
directory and the holder). Only temporary files of this process or of a process of this host that
is gone are removed (:mod:`.tmpnames`: temporary names carry the host and the pid), when the store
opens and at its first write.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import torch

from ..errors import SnapshotError
from ..rundir import AtomicFile, fsync_dir
from ..rundir.dirlock import DirLock, tmp_tag
from ..rundir.safefile import skip_links
from .fileformat import FileWriter, checksum, read_header, read_tensors
from .state import Captured, TrainState, validate_meta
from .store import SnapshotInfo, SnapshotStore, make_info, run_of
from .tmpnames import TMP_PREFIX as _TMP_PREFIX
from .tmpnames import stale

__all__ = ["SafetensorsStore", "load_snapshot", "list_snapshots", "snapshot_step"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^snapshot-(\d{10,})\.safetensors$")
_UNREADABLE = "\0unreadable"  # the run of a file whose header cannot be read (never anyone's)


def _stat_key(path: str) -> Optional[Tuple[int, int, int]]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def list_snapshots(directory: Union[str, os.PathLike]) -> List[str]:
    """Snapshot files in ``directory``, oldest step first; temporary and set-aside files excluded,
    and symbolic links too (named once in a warning: a reader is never led out of the directory)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    names = skip_links(directory, [n for n in names if _NAME.match(n)], "a snapshot")
    found = [(int(m.group(1)), n) for n in names if (m := _NAME.match(n))]
    return [os.path.join(os.fspath(directory), n) for _, n in sorted(found)]


def snapshot_step(path: Union[str, os.PathLike]) -> int:
    """The step in a snapshot file's name (``snapshot-0000000100.safetensors`` -> 100), or -1."""
    m = _NAME.match(os.path.basename(os.fspath(path)))
    return int(m.group(1)) if m else -1


def _load_file(path: str, state: TrainState) -> SnapshotInfo:
    header = read_header(path)
    meta = header.state()
    state.check_compatible(header.specs(), meta, path)  # before reading any tensor data
    tensors, _ = read_tensors(header)
    state.apply(tensors, meta, owned=True, where=path)
    log.debug("restored snapshot %s", path)
    return dataclasses.replace(make_info(meta, tensors, path, path), changed_since=tuple(state.changed))


class SafetensorsStore(SnapshotStore):
    """Snapshots as safetensors files in a directory: survive the process, verified on load.

    Args:
        directory: where the files go (created if needed). Leftover temporary files of a writer
            that is gone are removed at the first write.
        keep: number of this run's snapshot files kept.
        run_id: the run this store belongs to. ``None`` (the default, for direct use): continue
            the run of the newest snapshot in the directory (a fresh id when there is none), so a
            restarted process restores what it wrote. :func:`~.make.make_store` passes a fresh id:
            a new run that owns nothing until :meth:`adopt` (a resume).
        overwrite: a fresh run may start in a directory that holds another run's snapshots:
            :meth:`check_fresh` deletes them instead of raising.

    Example::

        >>> import tempfile
        >>> model = torch.nn.Linear(4, 2)
        >>> state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
        >>> with SafetensorsStore(tempfile.mkdtemp(), keep=2) as store:
        ...     info = store.save(state, {"step": 3, "epoch": 0, "batch": 3})
        ...     os.path.basename(store.restore(state).path)
        'snapshot-0000000003.safetensors'
    """

    def __init__(
        self,
        directory: Union[str, os.PathLike],
        keep: int = 2,
        run_id: Optional[str] = None,
        overwrite: bool = False,
    ) -> None:
        super().__init__(keep, run_id)
        self.directory = os.fspath(directory)
        self.overwrite = bool(overwrite)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            raise SnapshotError(
                f"{self.directory}: cannot create the snapshot directory: {exc.strerror or exc}"
            ) from None
        self._ids: Set[Optional[str]] = {self.run_id}  # the runs whose files are this store's
        self._runs: Dict[str, Tuple[Any, Optional[str]]] = {}  # path -> (stat key, run id): headers read once
        self._checked = False  # check_fresh passed, or the store continues a run (adopt)
        self._lock = DirLock(self.directory, "snapshots", _busy)  # taken at the first write, held until close()
        if self._take(wait_error=False):  # no writer now: clear what gone writers left, let go
            self._clean()
            self._lock.release()
        if run_id is None:
            for path in reversed(self.paths()):
                run = self._run(path)
                if run != _UNREADABLE:
                    self.adopt(run)  # the newest readable snapshot's run
                    break
        # One thread unlinks rotated files in the background (see _rotate).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="safetrain-snapshot")
        self._staging: Dict[str, torch.Tensor] = {}
        self._removals: List[Future] = []

    def paths(self) -> List[str]:
        """The snapshot files of every run, oldest step first."""
        return list_snapshots(self.directory)

    def _run(self, path: str) -> Optional[str]:
        """The run id in ``path``'s metadata (its header is read once per version of the file)."""
        key = _stat_key(path)
        cached = self._runs.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            run = run_of(read_header(path).state())
        except (SnapshotError, OSError, ValueError) as exc:
            log.debug("cannot read the run id of %s: %s", path, exc)
            # damaged since this store saw it: still that run's (restore tries it and sets it aside)
            run = cached[1] if cached is not None else _UNREADABLE
        self._runs[path] = (key, run)
        return run

    def own_paths(self) -> List[str]:
        """This run's snapshot files, oldest step first."""
        return [p for p in self.paths() if self._run(p) in self._ids]

    def foreign(self) -> List[str]:
        """Readable snapshots of other runs in the directory, oldest step first."""
        return [p for p in self.paths() if self._run(p) not in self._ids and self._run(p) != _UNREADABLE]

    def check_fresh(self) -> List[str]:
        """Refuse to start a fresh run here if the directory holds another run's snapshots.

        With ``overwrite`` they are deleted instead (and returned). Also run by the first save of
        a store that neither checked nor adopted a run.

        Raises:
            SnapshotError: naming the directory, the files, and the ways out.
        """
        self._require_open("check_fresh")
        others = self.foreign()
        self._checked = True
        if not others:
            return []
        if not self.overwrite:
            self._checked = False
            names = ", ".join(os.path.basename(p) for p in others[-3:])
            raise SnapshotError(
                f"{self.directory}: holds {len(others)} snapshot(s) of another run ({names}); a fresh run "
                "would mix with them. Continue that run with fit(..., resume=DIR) or resume='auto', give this "
                "run a new directory (snapshot.dir or log.dir), or set snapshot.overwrite: true to delete them"
            )
        for path in others:
            log.warning("snapshot.overwrite: deleting %s, a snapshot of another run", path)
            self._remove(path)
        fsync_dir(self.directory)
        return others

    def _adopt(self, run_id: Optional[str]) -> None:
        self._ids.add(run_id)
        self._checked = True

    def _take_lock(self, wait_error: bool = True) -> None:
        """Become the directory's one writer, then clear the temporary files of gone writers."""
        if self._take(wait_error):
            self._clean()

    def _take(self, wait_error: bool) -> bool:
        try:
            return self._lock.take(wait_error)
        except OSError as exc:
            raise SnapshotError(f"{self.directory}: cannot open the snapshot lock: {exc.strerror or exc}") from None

    def _clean(self) -> None:
        for name in os.listdir(self.directory):
            if name.startswith(_TMP_PREFIX) and stale(name):
                log.info("removing %s, left by an interrupted snapshot write", name)
                self._remove(os.path.join(self.directory, name))

    # -- save ----------------------------------------------------------------------------------

    def _to_host(self, tensors: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], Set[torch.device]]:
        """Contiguous CPU tensors to write, and the CUDA devices whose copies are still in flight.

        CUDA tensors are copied asynchronously into pinned buffers reused across saves.
        """
        out: Dict[str, torch.Tensor] = {}
        devices: Set[torch.device] = set()
        for name, t in tensors.items():
            if t.device.type == "cpu":
                out[name] = t.contiguous()
            elif t.device.type == "cuda":
                buf = self._staging.get(name)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = self._staging[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                devices.add(t.device)
                out[name] = buf
            else:
                out[name] = t.to("cpu").contiguous()
        for name in set(self._staging) - set(tensors):
            del self._staging[name]
        return out, devices

    def _save(self, captured: Captured) -> Optional[SnapshotInfo]:
        step = captured.meta["counters"]["step"]
        if step < 0:
            raise SnapshotError(f"counters['step']: got {step}; expected >= 0")
        final = os.path.join(self.directory, f"snapshot-{step:010d}.safetensors")
        self._take_lock()
        if not self._checked:
            self.check_fresh()
        if os.path.exists(final) and self._run(final) not in self._ids | {_UNREADABLE}:
            raise SnapshotError(f"{final}: a snapshot of another run is there; this run never replaces it")
        captured.meta["run_id"] = self.run_id
        tmp = os.path.join(self.directory, f"{_TMP_PREFIX}{tmp_tag()}-{step:010d}-{uuid.uuid4().hex[:8]}")
        state_json = json.dumps(captured.meta, separators=(",", ":"), allow_nan=False)
        host, devices = self._to_host(captured.tensors)
        target, writer = AtomicFile(final, tmp=tmp), None
        try:
            if devices:
                # The check runs on the device; its host read comes after the staging copies.
                if self._refused(captured):
                    return None
                for device in devices:
                    # host sync: the staged bytes must be in host memory before they are written.
                    torch.cuda.current_stream(device).synchronize()
                writer = FileWriter(tmp, host, state_json)
            else:
                # CPU: the data goes to disk while the check and the checksums run.
                writer = FileWriter(tmp, host, state_json)
                if self._refused(captured):
                    return None  # the writer is aborted below
            sums = {name: checksum(t) for name, t in host.items()}
            writer.finish(sums)  # the data, the header, fsync of the file
            writer = None
            target.commit(replace=self._publish)  # rename, then fsync the directory
            self._runs[final] = (_stat_key(final), self.run_id)
            self._passed.discard(final)  # a new file under that name
        except OSError as exc:
            raise SnapshotError(f"{final}: cannot write the snapshot: {exc.strerror or exc}") from None
        finally:
            if writer is not None:
                writer.abort()
            target.discard()  # the temporary file, unless it was committed
        self._rotate(step)
        log.debug("snapshot at step %d written to %s", step, final)
        return make_info(captured.meta, captured.tensors, final, final, copy=lambda n, t: t.clone())

    def _publish(self, tmp: str, final: str) -> None:
        """Rename ``tmp`` over ``final``; an older file of the same step is freed in the background.

        A save at a step that already has a file (after a rollback) would otherwise free the old
        file's blocks inside the rename: about 150 ms per 0.6 GB on a filesystem mounted with
        `discard`. A second hard link keeps the old inode alive through the rename, and the worker
        unlinks it; ``final`` names a whole file at every moment. Without hard links (some
        filesystems), the rename frees it in place.
        """
        hidden = os.path.join(
            self.directory, f"{_TMP_PREFIX}removed-{tmp_tag()}-{uuid.uuid4().hex[:8]}-{os.path.basename(final)}"
        )
        try:
            os.link(final, hidden)
        except OSError:  # no file at that step (the usual case), or no hard links here
            hidden = ""
        try:
            os.replace(tmp, final)
        finally:
            if hidden:
                self._removals.append(self._pool.submit(self._remove, hidden))

    def _rotate(self, step: int) -> None:
        paths = self.own_paths()  # another run's files are never touched
        doomed = []
        for path in paths:
            if int(_NAME.match(os.path.basename(path)).group(1)) > step:
                log.warning("removing %s: newer than step %d, from a run that was rolled back", path, step)
                doomed.append(path)
        kept = [p for p in paths if p not in doomed]
        usable = [p for p in kept if p not in self._passed]  # a passed-over file does not count toward keep
        if len(usable) > self.keep:
            oldest_kept = usable[len(usable) - self.keep]
            doomed += [p for p in kept if snapshot_step(p) < snapshot_step(oldest_kept)]
        for path in doomed:
            # Rename now (instant: the listing is right at once), unlink in the background: on a
            # filesystem mounted with `discard`, freeing gigabytes takes a noticeable time.
            hidden = os.path.join(self.directory, f"{_TMP_PREFIX}removed-{tmp_tag()}-{os.path.basename(path)}")
            self._passed.discard(path)
            try:
                os.replace(path, hidden)
            except FileNotFoundError:
                continue
            log.debug("removing old snapshot %s", path)
            self._removals.append(self._pool.submit(self._remove, hidden))
        self._removals = [f for f in self._removals if not f.done()]

    def drain(self) -> None:
        """Wait until rotated snapshot files are deleted (``close()`` does this too)."""
        for future in self._removals:
            future.result()
        self._removals = []

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    # -- restore -------------------------------------------------------------------------------

    def _candidates(self) -> Iterable[str]:
        return list(reversed(self.own_paths()))

    def _restore(self, path: str, state: TrainState) -> SnapshotInfo:
        return _load_file(path, state)

    def _info(self, path: str) -> SnapshotInfo:
        header = read_header(path)
        meta = header.state()
        validate_meta(meta, path)
        wanted = {f"extra/{n}" for n in meta.get("extra_tensors", [])}
        tensors, _ = read_tensors(header, only=wanted)
        return make_info(meta, tensors, path, path)

    def _discard(self, path: str) -> None:
        self._take_lock()
        self._remove(path)
        fsync_dir(self.directory)

    def _set_aside(self, path: str) -> None:
        try:
            os.replace(path, path + ".corrupt")
            log.warning("set aside damaged snapshot as %s.corrupt", path)
        except OSError:
            pass

    def _where(self) -> str:
        return self.directory

    def _close(self) -> None:
        self._pool.shutdown(wait=True)  # finishes pending removals of rotated files
        self._staging.clear()
        self._lock.release()


def _busy(directory: str, holder: str) -> SnapshotError:
    return SnapshotError(
        f"{directory}: another run is writing snapshots here ({holder}); two runs cannot share a snapshot "
        "directory: stop the other process or give this run its own snapshot.dir"
    )


def load_snapshot(path: Union[str, os.PathLike], state: TrainState) -> SnapshotInfo:
    """Load a snapshot file into ``state``, or the newest valid one of a directory (for resume).

    The file is checked before the live state is touched: format, checksums, and names, shapes
    and dtypes against the live model and optimizer. Nothing in the file can run code.

    Args:
        path: a ``.safetensors`` snapshot, or a directory of them (damaged ones are skipped,
            with a warning, left in place, and listed in the result's ``passed_over``).
        state: the :class:`TrainState` to write into.

    Returns:
        The :class:`SnapshotInfo` loaded: counters to resume from, extra state and tensors.

    Raises:
        SnapshotError: the file (or every file of the directory) is unusable; the message
            names each file and what is wrong.

    Example::

        >>> info = load_snapshot("runs/a/snapshots", state)   # doctest: +SKIP
        >>> start_step = info.step                            # doctest: +SKIP
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        if not os.path.exists(path):
            raise SnapshotError(f"{path}: no such snapshot file or directory")
        return _load_file(path, state)
    failures: List[Tuple[str, str]] = []
    for candidate in reversed(list_snapshots(path)):
        try:
            info = _load_file(candidate, state)
        except SnapshotError as exc:
            log.warning("snapshot unusable, trying an older one: %s", exc)
            failures.append((candidate, str(exc)))
            continue
        if failures:
            log.warning("resumed from %s, passing over %d newer file(s)", candidate, len(failures))
        passed = tuple((p, why[len(p) + 2 :] if why.startswith(f"{p}: ") else why) for p, why in failures)
        return dataclasses.replace(info, passed_over=passed)
    if not failures:
        raise SnapshotError(f"{path}: no snapshot files (snapshot-*.safetensors) in this directory")
    raise SnapshotError(f"{path}: no usable snapshot; " + "; ".join(why for _, why in failures))
