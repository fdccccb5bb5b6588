"""Overhead of the Lightning callback: ``Trainer.fit`` with ``SafeTrainingCallback`` against the same
``Trainer.fit`` without it, on the same model, data and settings (default safetrain config:
sanitizer, activation hooks, fused gradient check, spike detector, a memory snapshot every 100
healthy steps, one host sync per step).

Each round runs one short fit of every variant, the order rotated every round, a fresh model
from the same seed each time. A fit is timed from its ``warm``-th batch to its last (a timing
callback in every variant: Trainer setup, the first steps and teardown are left out), per step.
A variant's ratio in a round is its step time over the plain fit's; the table gives the median
over the rounds, the min-max of the per-round ratios, and the median ratio of process CPU time
per step (less moved by other processes on a shared machine than wall time).

Variants: ``plain`` (Lightning alone), ``safe`` (``SafeTrainingCallback()``, default config),
``safe_lazy`` (``detect.mode=lazy``: no forward hooks on the healthy path). The trainers have no
logger (``logger=False``), so the callback's logging (every ``log_every_n_steps``) costs nothing here.

Run: ``.venv/bin/python benchmarks/lightning_overhead.py --rounds 12 --steps 60``
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch: idle OpenMP threads must not spin for ms

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from safetrain.integrations.lightning import SafeTrainingCallback  # noqa: E402

MODELS: Dict[str, Dict[str, int]] = {
    # name: conv channels, image side, batch size
    "cnn-tiny": {"channels": 4, "side": 8, "batch": 8},
    "cnn-small": {"channels": 32, "side": 32, "batch": 64},
}


class CNN(pl.LightningModule):
    """Two conv blocks with BatchNorm, a linear head, SGD with momentum."""

    def __init__(self, channels: int, side: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        c = channels
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, c, 3, padding=1),
            torch.nn.BatchNorm2d(c),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c, 2 * c, 3, padding=1),
            torch.nn.BatchNorm2d(2 * c),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * c, 10),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)


class Clock(pl.Callback):
    """The wall time from the ``warm``-th training batch's start to the last batch's end."""

    def __init__(self, warm: int) -> None:
        self.warm, self.t0, self.t1, self.c0, self.c1, self.steps = warm, 0.0, 0.0, 0.0, 0.0, 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warm:
            self.t0, self.c0 = time.perf_counter(), time.process_time()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.t1, self.c1, self.steps = time.perf_counter(), time.process_time(), trainer.global_step - self.warm


VARIANTS: Dict[str, Callable[[], Optional[pl.Callback]]] = {
    "plain": lambda: None,
    "safe": lambda: SafeTrainingCallback({"log": {"level": "WARNING"}}),
    "safe_lazy": lambda: SafeTrainingCallback({"log": {"level": "WARNING"}, "detect": {"mode": "lazy"}}),
}


ACCELERATOR = "cpu"


def one_fit(variant: str, spec: Dict[str, int], loader: DataLoader, steps: int, warm: int, root: str) -> tuple:
    """Wall and process CPU seconds per step of one fit of ``variant``, past its ``warm`` first steps."""
    clock = Clock(warm)
    made = VARIANTS[variant]()
    callbacks = [clock] + ([made] if made is not None else [])
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator=ACCELERATOR,
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(CNN(spec["channels"], spec["side"]), loader)
    return (clock.t1 - clock.t0) / clock.steps, (clock.c1 - clock.c0) / clock.steps


def measure(name: str, variants: List[str], rounds: int, steps: int, warm: int, root: str) -> Dict[str, dict]:
    spec = MODELS[name]
    g = torch.Generator().manual_seed(0)
    n = spec["batch"] * steps
    x = torch.randn(n, 3, spec["side"], spec["side"], generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=spec["batch"], shuffle=False)
    for v in variants:  # warm-up: first-call costs
        one_fit(v, spec, loader, warm + 2, warm, root)
    times: Dict[str, List[float]] = {v: [] for v in variants}
    cpu: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            wall, used = one_fit(v, spec, loader, steps, warm, root)
            times[v].append(wall)
            cpu[v].append(used)
    out = {}
    for v in variants:
        ratios = [a / b for a, b in zip(times[v], times["plain"])]
        cpu_ratios = [a / b for a, b in zip(cpu[v], cpu["plain"])]
        out[v] = {"ms": statistics.median(times[v]) * 1e3, "ratio": statistics.median(ratios),
                  "min": min(ratios), "max": max(ratios), "cpu": statistics.median(cpu_ratios)}  # fmt: skip
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--variants", default="plain,safe,safe_lazy")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=60, help="steps per fit (the first --warm not timed)")
    p.add_argument("--warm", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (2 on a shared 2-core machine: OpenMP stalls)")
    p.add_argument("--accelerator", default="cpu", help="cpu or gpu (a CUDA device: the step waits for its read)")
    args = p.parse_args(argv)
    global ACCELERATOR
    ACCELERATOR = args.accelerator
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    variants = args.variants.split(",")
    if variants[0] != "plain":
        variants = ["plain"] + [v for v in variants if v != "plain"]
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), "safetrain-lightning-bench")
    print(f"torch {torch.__version__}, lightning {pl.__version__}, {args.accelerator}, {args.threads} threads, "
          f"{args.rounds} rounds x {args.steps - args.warm} timed steps")  # fmt: skip
    print("| model | " + " | ".join(variants[1:]) + " | plain ms/step |")
    print("| --- |" + " --- |" * len(variants))
    for name in args.models.split(","):
        res = measure(name, variants, args.rounds, args.steps, args.warm, root)
        cells = [
            f"{res[v]['ratio']:.2f}x ({res[v]['min']:.2f}-{res[v]['max']:.2f}), cpu {res[v]['cpu']:.2f}x"
            for v in variants[1:]
        ]
        print(f"| {name} | " + " | ".join(cells) + f" | {res['plain']['ms']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
