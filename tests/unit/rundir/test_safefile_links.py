"""Issue 36, the write half: no write of safetrain follows a link (or opens a FIFO, or writes into a
directory) that someone else planted at its path, and the lock folder in the shared temporary
directory is the user's own or refused.

Each case plants a symbolic link to a sentinel file (and, parametrized, a FIFO and a directory)
at a path safetrain writes, runs the writer as a run, ``safetrain report``, ``export`` or the demo
runs it, and checks that the sentinel is byte for byte unchanged and that the outcome is a clear
refusal naming the path or a correct write of safetrain's own file. ``CASES`` is checked against
:data:`safetrain.rundir.safefile.WRITERS`, and an AST scan checks that every write in ``safetrain/`` goes
through the helpers of :mod:`safetrain.rundir.safefile` from a writer listed there: a new writer without a
case here fails. ``safetrain inspect`` writes nothing: its reading side (and ``report``'s) is
checked at the end, a link out of the directory being refused or left out and named.

The model is the bug class of predictable names in shared directories (CWE-59, CWE-377): a
symbolic link planted in ``/tmp`` or a shared folder, followed by another user's write.
"""

from __future__ import annotations

import ast
import os
import signal
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Dict, NamedTuple, Optional

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.cli import main
from safetrain.errors import SafetrainError, SnapshotError
from safetrain.rundir import Journal, MetricsWriter, RunDirError, lock_run_dir, prepare_run_dir, read_run
from safetrain.rundir.dirlock import DirLock, lock_folder
from safetrain.rundir.safefile import WRITERS

pytestmark = pytest.mark.skipif(os.name == "nt", reason="symbolic links, FIFOs and POSIX modes")

ROOT = Path(__file__).resolve().parents[3]
SENTINEL = b"precious content: not safetrain's\n"
KINDS = ["symlink", "fifo", "directory"]


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """Lock files in this test's own temporary directory (the real one's folder is left alone),
    and a FIFO opened by mistake fails the test instead of hanging it."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    old = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("a write blocked (a FIFO opened?)"))
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _fit(run_dir: Path, steps: int = 6, snapshots: Optional[Path] = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(steps)]
    over = ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=2", f"log.dir={run_dir}"]
    if snapshots is not None:
        over.append(f"snapshot.dir={snapshots}")
    trainer = SafeTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.01), load_config(None, over), loss_fn=F.mse_loss
    )
    return trainer.fit(data)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """One tiny run (6 steps, snapshots at 1, 3, 5): the journal and metrics that report and plot read."""
    run = tmp_path_factory.mktemp("finished") / "run"
    _fit(run)
    return run


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A sharded (FSDP2 layout) snapshot directory written in this one process, for export."""
    directory = tmp_path_factory.mktemp("sharded")
    _save_sharded(directory)
    return directory


def _save_sharded(directory: Path):
    from safetrain.distributed.checkpoint import ShardedStore
    from safetrain.distributed.sharding import ShardedState

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = ShardedState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():  # "torch.distributed is uninitialized": one process, on purpose
        warnings.simplefilter("ignore", UserWarning)
        return ShardedStore(str(directory), keep=2, sync=None).save(state, {"step": 3, "epoch": 0, "batch": 3})


# -- planting ----------------------------------------------------------------------------------------


class Planted(NamedTuple):
    path: Path
    kind: str
    sentinel: Path  # a file (or, for a directory's writer, a directory) that must stay as it was

    def unchanged(self) -> bool:
        if self.sentinel.is_dir():
            return sorted(os.listdir(self.sentinel)) == ["keep"] and (self.sentinel / "keep").read_bytes() == SENTINEL
        return self.sentinel.read_bytes() == SENTINEL


def plant(path: Path, kind: str, outside: Path, target_dir: bool = False) -> Planted:
    """Put a ``kind`` at ``path``: a link to a sentinel outside (a file, or a directory holding
    one), a FIFO, or a directory."""
    outside.mkdir(parents=True, exist_ok=True)
    if target_dir:
        sentinel = outside / "sentinel-dir"
        sentinel.mkdir()
        (sentinel / "keep").write_bytes(SENTINEL)
    else:
        sentinel = outside / "sentinel"
        sentinel.write_bytes(SENTINEL)
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        os.symlink(sentinel, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
        (path / "keep").write_bytes(SENTINEL)
    return Planted(path, kind, sentinel)


def _lock_path(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    st = os.stat(directory)
    return Path(lock_folder()) / f"{st.st_dev}-{st.st_ino}.lock"


# -- the cases: one or more per writer of safetrain.rundir.safefile.WRITERS ---------------------------------
#
# Each case: where to plant (given the test's directory), and the write (given it, and the planted
# path); the write returns None or raises. `replaces`: a link or FIFO there is replaced by
# safetrain's own file (an atomic rename); otherwise every planted kind is refused.


class Case(NamedTuple):
    writer: str
    where: Callable[[Path], Path]
    write: Callable[[Path, Path], None]
    replaces: bool
    check: Optional[Callable[[Path], bool]] = None  # the file safetrain wrote, when it replaced
    target_dir: bool = False


def _journal(tmp: Path, path: Path) -> None:
    Journal(path).close()


def _metrics(tmp: Path, path: Path) -> None:
    MetricsWriter(path).close()


def _lock(tmp: Path, path: Path) -> None:
    lock_run_dir(tmp / "run").release()


def _probe(tmp: Path, path: Path, monkeypatch=None) -> None:
    prepare_run_dir(tmp / "run")


def _quarantine(tmp: Path, path: Path) -> None:
    from safetrain.diagnose.quarantine import write_quarantine

    write_quarantine(path, [3, 7])


def _report(tmp: Path, path: Path) -> None:
    """`safetrain report RUN` (the plot's error is a note on stderr, exit 0)."""
    pytest.importorskip("matplotlib")  # the plot extra (in dev); without it no report.png is written
    assert main(["report", str(path.parent)]) == 0
    if not (path.is_file() and not path.is_symlink()):
        raise SafetrainError("report.png not written")


def _demo(tmp: Path, path: Path) -> None:
    from safetrain.cli.demo import DemoSize, demo_config, run_demo

    run_demo(
        demo_config(out=str(path.parent)), DemoSize(n_train=128, n_test=64, epochs=1, hidden=8), clean=False, plot=False
    )


def _snapshot(tmp: Path, path: Path) -> None:
    from safetrain.snapshot import SafetensorsStore
    from safetrain.snapshot.state import TrainState

    model = torch.nn.Linear(4, 2)
    with SafetensorsStore(path.parent, keep=2) as store:
        store.save(TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), {"step": 3, "epoch": 0, "batch": 3})


def _write_json(tmp: Path, path: Path) -> None:
    from safetrain.distributed.snapdir import write_json

    write_json(str(path), {"format": "safetrain.sharded"})


def _sharded(tmp: Path, path: Path) -> None:
    _save_sharded(path.parent)


def _export(tmp: Path, path: Path) -> None:
    if main(["export", str(tmp / "sharded"), str(path)]) != 0:
        raise SafetrainError("export refused (its sentence is on stderr)")


def _tensorboard(tmp: Path, path: Path) -> None:
    pytest.importorskip("tensorboard")
    from safetrain.hooks import TensorBoardHook

    TensorBoardHook(path).on_end(None)


def _is_png(p: Path) -> bool:
    return p.read_bytes().startswith(b"\x89PNG")


def _is_snapshot(p: Path) -> bool:
    from safetrain.snapshot.header import read_header

    return read_header(str(p)).state()["counters"]["step"] == 3


def _is_model(p: Path) -> bool:
    from safetensors.torch import load_file

    return set(load_file(str(p))) == {"weight", "bias"}


CASES: Dict[str, Case] = {
    "lock file": Case("safetrain.rundir.dirlock:DirLock.take", lambda t: _lock_path(t / "run"), _lock, False),
    "write probe": Case("safetrain.rundir:prepare_run_dir", lambda t: t / "run" / ".write-test-fixed", _probe, False),
    "events.jsonl": Case("safetrain.rundir:_open_appending", lambda t: t / "run" / "events.jsonl", _journal, False),
    "events-rank1.jsonl": Case(
        "safetrain.rundir:_open_appending", lambda t: t / "run" / "events-rank1.jsonl", _journal, False
    ),
    "metrics.csv": Case("safetrain.rundir:_open_appending", lambda t: t / "run" / "metrics.csv", _metrics, False),
    "quarantine.json": Case(
        "safetrain.diagnose.quarantine:write_quarantine",
        lambda t: t / "run" / "quarantine.json",
        _quarantine,
        True,
        lambda p: b'"indices"' in p.read_bytes(),
    ),
    "report.png": Case("safetrain.cli.plot:plot_run", lambda t: t / "run" / "report.png", _report, True, _is_png),
    "demo report.txt": Case(
        "safetrain.cli.demo:run_demo",
        lambda t: t / "demo" / "report.txt",
        _demo,
        True,
        lambda p: b"events" in p.read_bytes(),
    ),
    "snapshot file": Case(
        "safetrain.snapshot.fileformat:FileWriter.__init__",
        lambda t: t / "snaps" / "snapshot-0000000003.safetensors",
        _snapshot,
        True,
        _is_snapshot,
    ),
    "sharded mark": Case(
        "safetrain.distributed.snapdir:write_json",
        lambda t: t / "step" / "safetrain.json",
        _write_json,
        True,
        lambda p: b"safetrain.sharded" in p.read_bytes(),
    ),
    "sharded step dir": Case(
        "safetrain.distributed.checkpoint:save_sharded",
        lambda t: t / "shards" / "step-0000000003",
        _sharded,
        True,
        lambda p: p.is_dir() and (p / "safetrain.json").is_file(),
        target_dir=True,
    ),
    "export": Case(
        "safetrain.distributed.export:export_model", lambda t: t / "out" / "model.safetensors", _export, True, _is_model
    ),
    "tensorboard dir": Case(
        "safetrain.hooks:TensorBoardHook.__init__",
        lambda t: t / "run" / "tensorboard",
        _tensorboard,
        False,
        lambda p: p.is_dir() and any(f.name.startswith("events.out.tfevents") for f in p.iterdir()),
        target_dir=True,
    ),
}


def test_every_writer_has_a_planted_link_case():
    missing = set(WRITERS) - {case.writer for case in CASES.values()}
    assert not missing, f"writers without a planted-link case in this file: {sorted(missing)}"
    unknown = {case.writer for case in CASES.values()} - set(WRITERS)
    assert not unknown, f"cases of writers safetrain.rundir.safefile.WRITERS does not list: {sorted(unknown)}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(CASES))
def test_a_planted_path_is_never_written_through(name, kind, tmp_path, monkeypatch, finished_run, sharded, capsys):
    case = CASES[name]
    where = case.where(tmp_path)
    if name == "write probe":  # its name is random: make it known, as an attacker racing it would guess
        monkeypatch.setattr("safetrain.rundir.uuid.uuid4", lambda: type("U", (), {"hex": "fixed000"})())
        where = tmp_path / "run" / f".write-test-{os.getpid()}-fixed000"
    if name == "report.png":
        (tmp_path / "run").mkdir()
        for f in ("events.jsonl", "metrics.csv"):
            (tmp_path / "run" / f).write_bytes((finished_run / f).read_bytes())
    if name == "export":
        os.symlink(sharded, tmp_path / "sharded")
    planted = plant(where, kind, tmp_path / "outside", case.target_dir and kind == "symlink")
    try:
        case.write(tmp_path, where)
    except (SafetrainError, OSError) as exc:
        outcome: Optional[BaseException] = exc
    else:
        outcome = None
    err = capsys.readouterr().err
    assert planted.unchanged(), f"{name}: the {kind}'s target was written through"
    if kind == "directory" and name != "sharded step dir":  # (a step-* directory is the run's to clear)
        assert (where / "keep").read_bytes() == SENTINEL, f"{name}: the directory's content"
    if case.replaces and kind != "directory" or name == "sharded step dir" or (case.target_dir and kind == "directory"):
        assert outcome is None, f"{name}: {kind} should be replaced by safetrain's own file, got {outcome!r} {err}"
        st = os.lstat(where)
        assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode), f"{name}: {where} is not safetrain's own"
        assert case.check(where), f"{name}: {where} does not hold what safetrain wrote"
        return
    assert outcome is not None, f"{name}: a planted {kind} was accepted without a word"
    text = f"{outcome} {err}"
    assert isinstance(outcome, SafetrainError), f"{name}: a sentence, not a bare {outcome!r}"
    assert str(where) in text, f"{name}: the refusal names the path: {text}"
    assert f"is a {kind.replace('fifo', 'FIFO').replace('symlink', 'symbolic link')}" in text, text


# -- the reproductions, end to end -----------------------------------------------------------


def test_a_link_at_the_lock_path_leaves_its_target_whole_and_the_run_is_refused(tmp_path):
    """Issue 36, reproduction 1: a link planted at the lock file's path; one fit with log.dir set
    left the linked file empty (truncated through the link), and said nothing."""
    run = tmp_path / "run"
    planted = plant(_lock_path(run), "symlink", tmp_path / "outside")
    with pytest.raises(RunDirError, match="symbolic link") as info:
        _fit(run)
    assert planted.unchanged(), "the lock truncated a file through a link"
    assert str(planted.path) in str(info.value)


def test_report_png_through_a_link_is_replaced_not_written_through(tmp_path, finished_run, capsys):
    """Issue 36, reproduction 2: `safetrain report DIR` wrote report.png through a link."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    for f in ("events.jsonl", "metrics.csv"):
        (run / f).write_bytes((finished_run / f).read_bytes())
    planted = plant(run / "report.png", "symlink", tmp_path / "outside")
    assert main(["report", str(run)]) == 0
    assert planted.unchanged() and not (run / "report.png").is_symlink() and _is_png(run / "report.png")


def test_a_run_with_links_planted_at_its_snapshots_writes_its_own_files(tmp_path):
    """A whole fit with log.dir and a snapshot directory: links planted at the snapshot names it
    will write are replaced by its own snapshots, and what they point to is untouched."""
    run, snaps = tmp_path / "run", tmp_path / "snaps"
    planted = [plant(snaps / f"snapshot-{s:010d}.safetensors", "symlink", tmp_path / f"out{s}") for s in (3, 5)]
    result = _fit(run, snapshots=snaps)
    assert result.steps == 6 and all(p.unchanged() for p in planted)
    assert sorted(os.listdir(snaps)) == ["snapshot-0000000003.safetensors", "snapshot-0000000005.safetensors"]
    assert not any((snaps / n).is_symlink() for n in os.listdir(snaps))
    assert read_run(run).summary["steps"] == 6


# -- the lock folder ---------------------------------------------------------------------------------


def _folder(tmp: Path) -> Path:
    return Path(tempfile.gettempdir()) / f"safetrain-locks-{os.getuid()}"


@pytest.mark.parametrize("how", ["another owner", "group-writable", "world-writable", "a link", "a file"])
def test_a_lock_folder_someone_else_could_have_made_is_refused(how, tmp_path):
    """The folder in the shared temporary directory, made first by someone else (or loose): the
    run is refused with a sentence naming the folder, its owner and mode, and what to do."""
    folder = _folder(tmp_path)
    if how == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        os.symlink(tmp_path / "elsewhere", folder)
    elif how == "a file":
        folder.write_bytes(SENTINEL)
    else:
        folder.mkdir(mode=0o700)
        if how == "another owner":
            if os.geteuid() != 0:
                pytest.skip("making a folder another user's needs root")
            os.chown(folder, 4242, 4242)
        os.chmod(folder, {"another owner": 0o700, "group-writable": 0o770, "world-writable": 0o777}[how])
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(RunDirError) as info:
        lock_run_dir(run)
    text = str(info.value)
    assert str(folder) in text and "owner uid" in text and "mode" in text and "TMPDIR" in text, text
    with pytest.raises(RunDirError, match="folder of safetrain's directory locks"):
        _fit(run)
    with pytest.raises(SnapshotError, match="folder of safetrain's directory locks"):
        from safetrain.snapshot import SafetensorsStore

        SafetensorsStore(tmp_path / "snaps")._take_lock()
    assert how != "a file" or folder.read_bytes() == SENTINEL
    assert how != "a link" or os.listdir(tmp_path / "elsewhere") == [], "nothing made through the link"


def test_the_lock_folder_is_made_private_and_a_normal_lock_still_works(tmp_path):
    lock = DirLock(str(tmp_path), "run", lambda d, who: RuntimeError(who))
    assert lock.take()
    st = os.lstat(_folder(tmp_path))
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.stat(lock._path()).st_mode) & 0o077 == 0, "the lock file is the user's alone"
    lock.release()


# -- every write goes through safetrain.rundir.safefile -----------------------------------------------------

_HELPERS = {
    "create_new",
    "open_append",
    "open_private",
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_save",
    "real_dir",
}
# Writes that open a file by other means, with why they are safe.
_ALLOWED = {
    ("safetrain.cli", "main"): "os.open(os.devnull): the null device, after a broken pipe",
}


def _writes(tree: ast.AST):
    """(enclosing Class.function, call, what) of each call that writes a file or calls a helper."""
    found = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Call):
                f = child.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in _HELPERS:
                    found.append((scope, "helper"))
                elif name == "open" and isinstance(f, ast.Name):
                    mode = (
                        child.args[1]
                        if len(child.args) > 1
                        else next((k.value for k in child.keywords if k.arg == "mode"), None)
                    )
                    text = mode.value if isinstance(mode, ast.Constant) else "r"
                    if set(text) & set("wax+"):
                        found.append((scope, f"open(..., {text!r})"))
                elif name == "open" and isinstance(f, ast.Attribute) and ast.unparse(f.value) == "os":
                    flags = ast.unparse(child.args[1]) if len(child.args) > 1 else ""
                    if any(w in flags for w in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC")):
                        found.append((scope, f"os.open(..., {flags})"))
                elif name == "open" and isinstance(f, ast.Attribute):  # Path.open("w"), not Run.open()
                    mode = (
                        child.args[0]
                        if child.args
                        else next((k.value for k in child.keywords if k.arg == "mode"), None)
                    )
                    if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                        found.append((scope, f".open({mode.value!r})"))
                elif name in ("copy", "copy2", "copyfile", "move") and ast.unparse(f).startswith("shutil."):
                    found.append((scope, ast.unparse(f)))
                elif name in ("write_text", "write_bytes", "save_file", "savefig", "to_csv", "mkfifo", "save"):
                    if name == "save" and ast.unparse(f) not in ("torch.save", "np.save", "numpy.save"):
                        pass
                    elif not (name == "savefig" and ast.unparse(child.args[0]) == "png"):  # into a BytesIO
                        if not (name == "save_file" and _in_lambda(tree, child)):  # inside atomic_save
                            found.append((scope, name))
            visit(child, inner)

    visit(tree, "")
    return found


def _in_lambda(tree: ast.AST, call: ast.Call) -> bool:
    return any(isinstance(n, ast.Lambda) and call in ast.walk(n.body) for n in ast.walk(tree))


def test_the_scan_sees_the_usual_ways_to_write_a_file():
    code = (
        "def f(p):\n open(p, 'w')\n open(p, mode='ab')\n Path(p).write_text('x')\n Path(p).open('a')\n"
        " os.open(p, os.O_WRONLY | os.O_CREAT)\n fig.savefig(p)\n torch.save(x, p)\n shutil.copy(a, p)\n"
        " open(p)\n open(p, 'rb')\n os.open(p, os.O_RDONLY)\n run.open(share=s)\n fig.savefig(png)\n"
    )
    assert [what for _, what in _writes(ast.parse(code))] == [
        "open(..., 'w')",
        "open(..., 'ab')",
        "write_text",
        ".open('a')",
        "os.open(..., os.O_WRONLY | os.O_CREAT)",
        "savefig",
        "save",
        "shutil.copy",
    ]


def test_every_write_in_safetrain_goes_through_safefile_from_a_listed_writer():
    helper_sites, bypass = set(), []
    for path in sorted((ROOT / "safetrain").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module in ("safetrain.rundir.safefile", "safetrain.rundir.atomicfile"):  # the helpers themselves
            continue
        for scope, what in _writes(ast.parse(path.read_text(encoding="utf-8"))):
            if what == "helper":
                helper_sites.add(f"{module}:{scope}")
            elif (module, scope) not in _ALLOWED:
                bypass.append(f"{module}:{scope}: {what}")
    assert not bypass, (
        f"writes that bypass safetrain.rundir.safefile (a link planted at the path is followed): {bypass}"
    )
    unlisted = helper_sites - set(WRITERS)
    assert not unlisted, (
        f"writers not in safetrain.rundir.safefile.WRITERS (add them, and a case here): {sorted(unlisted)}"
    )
    gone = set(WRITERS) - helper_sites
    assert not gone, f"WRITERS lists writers that no longer write: {sorted(gone)}"


# -- reading a run directory does not follow links out of it -----------------------------------------


def test_report_refuses_a_journal_that_is_a_link_out_of_the_run_directory(tmp_path, finished_run, capsys):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(finished_run / "events.jsonl", run / "events.jsonl")
    assert main(["report", str(run), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert str(run / "events.jsonl") in err and "is a symbolic link" in err and "follow links" in err, err


def test_a_link_among_the_snapshots_is_ignored_and_named(tmp_path, finished_run, caplog):
    """A resume or `inspect DIR` never reads a file outside the snapshot directory through a link."""
    import logging

    from safetrain.snapshot import list_snapshots

    snaps = tmp_path / "snaps"
    snaps.mkdir()
    real = sorted(os.listdir(finished_run / "snapshots"))[-1]
    os.symlink(finished_run / "snapshots" / real, snaps / "snapshot-0000000009.safetensors")
    with caplog.at_level(logging.WARNING, logger="safetrain"):
        assert list_snapshots(snaps) == []
        assert main(["inspect", str(snaps)]) == 2, "`safetrain inspect DIR` finds no snapshot of its own there"
    assert "snapshot-0000000009.safetensors: a symbolic link" in caplog.text
    from safetrain.diagnose.quarantine import read_quarantine

    os.symlink(finished_run / "events.jsonl", tmp_path / "quarantine.json")
    with pytest.raises(SafetrainError, match="is a symbolic link"):
        read_quarantine(tmp_path / "quarantine.json")


def test_files_are_never_writable_by_others_whatever_the_umask(tmp_path):
    from safetrain.snapshot import SafetensorsStore
    from safetrain.snapshot.state import TrainState

    old = os.umask(0)
    try:
        model = torch.nn.Linear(4, 2)
        with SafetensorsStore(tmp_path / "snaps", keep=2) as store:
            info = store.save(
                TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1)), {"step": 1, "epoch": 0, "batch": 1}
            )
        Journal(tmp_path / "events.jsonl").close()
        from safetrain.diagnose.quarantine import write_quarantine

        write_quarantine(tmp_path / "quarantine.json", [1])
    finally:
        os.umask(old)
    for path in (info.path, tmp_path / "events.jsonl", tmp_path / "quarantine.json"):
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o002 == 0, f"{path}: writable by others"
