"""``safetrain demo``: a small training run with realistic faults, next to the same run without them.

Cost: two short ``SafeTrainer.fit`` runs on one CPU thread (a few seconds each by default). At the top of the layers,
under :mod:`safetrain.cli`'s ``demo`` command: :func:`run_demo` (what it trains and injects), :func:`format_summary`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ..config import TrainConfig, as_config, load_config, to_dict
from ..errors import ConfigError, TrainingAborted
from ..rundir import ReportError, read_run
from ..rundir.atomicfile import atomic_write_text
from .plot import plot_run
from .report import format_report

__all__ = ["DemoSize", "DemoResult", "LogNormFeatures", "demo_config", "run_demo", "format_summary"]

logger = logging.getLogger(__name__)

#: Settings the demo uses unless the config file or an override sets them: a short run wants
#: snapshots more often than the default's every 100 healthy steps.
DEMO_DEFAULTS: Dict[str, str] = {"snapshot.every": "25"}


@dataclass(frozen=True)
class DemoSize:
    """How big the demo is; the default takes a few seconds per run on two CPU cores.

    Attributes:
        n_train: training samples.
        n_test: held-out samples the accuracy is measured on.
        dim: input features.
        classes: classes (each a mixture of two Gaussians).
        hidden: width of the two hidden layers.
        batch_size: samples per batch.
        epochs: passes over the training set.
        lr: AdamW learning rate.
        seed: seed of the data, the initial weights and the shuffle.
    """

    n_train: int = 8192
    n_test: int = 4096
    dim: int = 16
    classes: int = 4
    hidden: int = 64
    batch_size: int = 64
    epochs: int = 6
    lr: float = 3e-3
    seed: int = 0


@dataclass
class DemoResult:
    """What :func:`run_demo` came to.

    Attributes:
        run_dir: the run directory (``log.dir``).
        result: the ``FitResult`` of the run with faults.
        clean: the ``FitResult`` of the same run without faults (``None`` if not run).
        accuracy: held-out accuracy of the run with faults (0..1).
        clean_accuracy: held-out accuracy without faults (``nan`` if not run).
        faults: ``(step, description)`` of every fault injected, in order.
        size: the :class:`DemoSize` used.
        png: the ``report.png`` written, or ``None`` (no matplotlib, or no metrics).
        notes: things the user should know (a missing plot dependency...).
        wall_time: seconds for both runs and the report.
    """

    run_dir: Path
    result: Any
    clean: Any
    accuracy: float
    clean_accuracy: float
    faults: List[Tuple[int, str]]
    size: DemoSize
    png: Optional[Path] = None
    notes: List[str] = field(default_factory=list)
    wall_time: float = 0.0


class LogNormFeatures(torch.nn.Module):
    """Appends ``log(|x|^2)`` to each row: a useful scale feature, and ``-inf`` for an all-zero row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.log(x.pow(2).sum(dim=1, keepdim=True))], dim=1)


def _model(size: DemoSize) -> torch.nn.Module:
    torch.manual_seed(size.seed)
    h = size.hidden
    return torch.nn.Sequential(
        LogNormFeatures(),
        torch.nn.Linear(size.dim + 1, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, h),
        torch.nn.ReLU(),
        torch.nn.Linear(h, size.classes),
    )


def _data(size: DemoSize) -> Tuple[TensorDataset, TensorDataset]:
    """A Gaussian mixture: two components per class, overlapping enough to keep accuracy below 100%."""
    g = torch.Generator().manual_seed(size.seed)
    centers = 0.7 * torch.randn(2 * size.classes, size.dim, generator=g)
    n = size.n_train + size.n_test
    component = torch.randint(2 * size.classes, (n,), generator=g)
    x = centers[component] + torch.randn(n, size.dim, generator=g)
    y = component % size.classes
    return (TensorDataset(x[: size.n_train], y[: size.n_train]), TensorDataset(x[size.n_train :], y[size.n_train :]))


class _Faults:
    """Wraps the loader: poisons dataset rows, zeroes a row of one batch, corrupts one batch's labels,
    and multiplies the LR by 1000 for two optimizer steps through the optimizer's public step hooks."""

    def __init__(self, loader: DataLoader, optimizer: torch.optim.Optimizer, size: DemoSize, steps: int) -> None:
        self.loader, self.size, self.trainer = loader, size, None
        self.zero_row_at = max(2, round(0.22 * steps))
        self.labels_at = max(3, round(0.45 * steps))
        self.lr_at = max(4, round(0.64 * steps))  # optimizer-step count, so the blow-up is trained on
        self.batches, self.optimizer_steps = 0, 0
        self.log: List[Tuple[int, str]] = []
        self._saved: Optional[List[float]] = None
        x = loader.dataset.tensors[0]  # type: ignore[attr-defined]
        g = torch.Generator().manual_seed(size.seed + 1)
        self.poisoned = sorted(torch.randperm(len(x), generator=g)[:3].tolist())
        x[self.poisoned, 0] = math.nan
        self.log.append(
            (
                0,
                f"{len(self.poisoned)} training rows hold NaN (dataset indices "
                f"{', '.join(map(str, self.poisoned))}), seen once per epoch",
            )
        )
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.loader:
            self.batches += 1
            if self.batches == self.zero_row_at:
                x = x.clone()
                x[0] = 0.0
                self.log.append((self.batches, "an all-zero input row: the model's log(|x|^2) feature takes log(0)"))
            if self.batches == self.labels_at:
                y = (y + 1) % self.size.classes
                self.log.append((self.batches, "every label of the batch is wrong: a loss spike"))
            yield x, y

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_steps += 1
        if self.optimizer_steps in (self.lr_at, self.lr_at + 1):
            self._saved = [g["lr"] for g in optimizer.param_groups]
            for g in optimizer.param_groups:
                g["lr"] *= 1000.0
            step = self.trainer.guard.steps if self.trainer is not None and self.trainer.guard else -1
            nth = 1 + (self.optimizer_steps - self.lr_at)
            self.log.append(
                (
                    step,
                    f"LR x1000 for one optimizer step ({nth} of 2; a scheduler bug): "
                    f"lr {self._saved[0]:g} -> {optimizer.param_groups[0]['lr']:g}",
                )
            )

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved is not None:
            for g, lr in zip(optimizer.param_groups, self._saved):
                g["lr"] = lr
            self._saved = None

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def demo_config(
    path: Union[None, str, os.PathLike] = None, overrides: Sequence[str] = (), out: Union[None, str, os.PathLike] = None
) -> TrainConfig:
    """The demo's configuration: safetrain's defaults <- :data:`DEMO_DEFAULTS` <- ``path`` <- ``overrides``.

    Args:
        path: a YAML config file (its keys win over the demo's defaults), or ``None``.
        overrides: dotted ``KEY=VALUE`` strings.
        out: the run directory; else ``log.dir`` from the config, else ``runs/demo-<timestamp>``.

    Raises:
        ConfigError: as :func:`safetrain.load_config`, or the run directory already holds a run.
    """
    given = _keys_in(path) if path is not None else set()
    given |= {item.split("=", 1)[0].strip() for item in overrides if isinstance(item, str)}
    layer = [f"{k}={v}" for k, v in DEMO_DEFAULTS.items() if k not in given]  # no "set twice" note for these
    cfg = load_config(path, [*layer, *overrides])
    data = to_dict(cfg)
    run_dir = Path(out or cfg.log.dir or _fresh(Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")))
    if (run_dir / "events.jsonl").exists():
        raise ConfigError(
            f"log.dir: {run_dir} already holds a run (events.jsonl); the demo writes a fresh run "
            "directory: pass another --out, or leave it out for runs/demo-<timestamp>"
        )
    data["log"]["dir"] = str(run_dir)
    return as_config(data)


def _fresh(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``... when it exists (two demos started in the same second)."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _keys_in(path: Union[str, os.PathLike]) -> set:
    """Dotted keys a YAML file sets (unreadable files are left for load_config to report)."""
    from ..config.yamlfile import read_yaml

    try:
        data = read_yaml(Path(path))  # bounded: /dev/zero is refused, not read for ever
    except ConfigError:  # load_config names the problem
        return set()
    keys: set = set()

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                keys.add(prefix + str(k))
                walk(v, f"{prefix}{k}.")

    walk(data, "")
    return keys


def _accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).float().mean().item()
    model.train()
    return correct


def _fit(cfg: TrainConfig, size: DemoSize, faults: bool) -> Tuple[Any, float, List[Tuple[int, str]]]:
    from ..trainer import SafeTrainer

    train, test = _data(size)
    loader = DataLoader(
        train, batch_size=size.batch_size, shuffle=True, generator=torch.Generator().manual_seed(size.seed)
    )
    model = _model(size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.lr)
    injector = _Faults(loader, optimizer, size, size.epochs * len(loader)) if faults else None
    trainer = SafeTrainer(model, optimizer, cfg, loss_fn=F.cross_entropy)
    if injector is not None:
        injector.trainer = trainer
    try:
        result = trainer.fit(injector if injector is not None else loader, epochs=size.epochs)
    except TrainingAborted as exc:
        result = exc.result
    finally:
        if injector is not None:
            injector.remove()
    return result, _accuracy(model, test), sorted(injector.log) if injector is not None else []


def run_demo(
    cfg: Optional[TrainConfig] = None, size: DemoSize = DemoSize(), clean: bool = True, plot: bool = True
) -> DemoResult:
    """Train with injected faults under safetrain, then (``clean``) the same run without faults, and report.

    A 2-hidden-layer MLP learns a synthetic Gaussian-mixture classification task (no download, fixed seeds, a few
    seconds on two CPU cores). Along the way the demo injects what goes wrong in real runs: poisoned rows in the
    dataset (NaN features), an all-zero row that sends the model's ``log(|x|^2)`` feature to ``log(0) = -inf``, a
    batch with corrupted labels (a loss spike), and a learning rate multiplied by 1000 for two optimizer steps
    (through the optimizer's step hooks). safetrain journals and recovers from each; the same run without faults
    gives the reference accuracy. The run directory gets ``events.jsonl``, ``metrics.csv``, ``report.txt`` and
    ``report.png``.

    Args:
        cfg: the configuration (:func:`demo_config`); its ``log.dir`` is the run directory.
        size: problem size, epochs and seed.
        clean: also run without faults for the reference accuracy.
        plot: write ``report.png`` (needs matplotlib).

    Returns:
        The :class:`DemoResult`. A run the policy aborted is reported, not raised.

    Example::

        >>> demo = run_demo(demo_config(out="runs/demo"), DemoSize(epochs=2))  # doctest: +SKIP
        >>> demo.accuracy, demo.clean_accuracy  # doctest: +SKIP
    """
    started = time.perf_counter()
    cfg = cfg if cfg is not None else demo_config()
    if cfg.log.dir is None:
        raise ValueError("run_demo: cfg.log.dir is not set; build the config with demo_config()")
    run_dir = Path(cfg.log.dir)
    # One thread: a model this small runs ~10x faster than with OpenMP threads that spin-wait
    # for each other (and far faster still when other processes share the cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result, accuracy, faults = _fit(cfg, size, faults=True)
        clean_result, clean_accuracy = None, math.nan
        if clean:
            reference = to_dict(cfg)
            reference["log"].update(dir=None, level="WARNING")
            logger.info("the same run without faults, for the reference accuracy...")
            clean_result, clean_accuracy, _ = _fit(as_config(reference), size, faults=False)
    finally:
        torch.set_num_threads(threads)
    demo = DemoResult(run_dir, result, clean_result, accuracy, clean_accuracy, faults, size)
    run = read_run(run_dir)
    atomic_write_text(run_dir / "report.txt", format_report(run) + "\n")  # a link there is replaced, not followed
    if plot:
        try:
            demo.png = plot_run(run)
        except ReportError as exc:
            demo.notes.append(str(exc))
    demo.wall_time = time.perf_counter() - started
    return demo


def format_summary(demo: DemoResult) -> str:
    """The demo's closing text: each fault injected beside what safetrain did about it, the anomalies
    by kind, the counters, both accuracies and where the run directory is (all read from the journal).

    Example::

        >>> cfg = demo_config(out="runs/demo")                      # doctest: +SKIP
        >>> demo = run_demo(cfg)                                    # doctest: +SKIP
        >>> print(format_summary(demo))                             # doctest: +SKIP
    """
    s, r = demo.size, demo.result
    run = read_run(demo.run_dir)
    found = [e for e in run.events if e["event"] == "anomaly"]
    lines = [
        f"\nsafetrain demo: {s.classes}-class Gaussian mixture, MLP {s.dim}+1-{s.hidden}-{s.hidden}-{s.classes}, "
        f"{s.epochs} epochs of {math.ceil(s.n_train / s.batch_size)} batches",
        "",
        "faults injected -> what safetrain did:",
    ]
    starts = [step for step, _ in demo.faults] + [10**12]
    for (step, what), end in zip(demo.faults, starts[1:]):
        if step <= 0:
            hits = [e for e in found if e["kind"] in ("input", "target")]
            did = f"{len(hits)} x {hits[0]['action']} (each time the rows came round)" if hits else "not seen"
        else:
            hits = [e for e in found if step <= e["step"] < min(end, step + 6) and e["kind"] not in ("input", "target")]
            did = "; ".join(f"step {e['step']} {e['kind']}: {e['action']}" for e in hits) or "not seen"
        lines += [f"  {'step ' + str(step) if step > 0 else 'data':>9}  {what}", f"{'':>13}-> {did}"]
    lines += ["", "anomalies by kind (events.jsonl):"]
    kinds: Dict[str, Dict[str, int]] = {}
    first: Dict[str, int] = {}
    for e in found:
        kinds.setdefault(e["kind"], {}).setdefault(e["action"], 0)
        kinds[e["kind"]][e["action"]] += 1
        first.setdefault(e["kind"], e["step"])
    for kind, actions in kinds.items():
        did = ", ".join(f"{n} x {action}" for action, n in actions.items())
        lines.append(f"  {kind:<9} {did:<44} first at step {first[kind]}")
    if not kinds:
        lines.append("  none: every step was healthy")
    if r is not None:
        lines += [
            "",
            f"result: {r.steps} steps, {r.healthy_steps} healthy, {r.skipped_batches} skipped, "
            f"{r.dropped_rows} rows dropped, {r.zeroed_grads} gradients zeroed, {r.restores} restores, "
            f"LR scale {r.lr_scale:g}" + (" - ABORTED by the policy" if r.aborted else ""),
        ]
    lines.append(
        f"accuracy: {100 * demo.accuracy:.1f}% with faults under safetrain"
        + (
            ""
            if math.isnan(demo.clean_accuracy)
            else f", {100 * demo.clean_accuracy:.1f}% for the same run without faults "
            f"({100 * (demo.accuracy - demo.clean_accuracy):+.1f} points)"
        )
    )
    lines += [
        "",
        f"run directory: {demo.run_dir}  (events.jsonl, metrics.csv, report.txt"
        + (", report.png)" if demo.png else ")"),
        f"  see it again with: safetrain report {demo.run_dir}",
    ]
    lines += [f"note: {n}" for n in demo.notes]
    lines.append(f"done in {demo.wall_time:.1f} s")
    return "\n".join(lines)
