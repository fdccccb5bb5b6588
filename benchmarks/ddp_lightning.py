"""Overhead of the Lightning callback under DDP: ``Trainer(strategy="ddp", devices=2)`` on 2 gloo
ranks with ``SafeTrainingCallback`` against the same ``Trainer`` without it.

The script starts itself under ``torch.distributed.run`` (2 processes, one torch thread each), so
Lightning finds its processes made for it and every fit of every round runs in the same two
processes (one process group; no launch per fit). Each round runs one short fit of every variant,
the order rotated every round, a fresh model from the same seed each time; a fit is timed from
its ``warm``-th batch to its last (a timing callback in every variant), per step, and a fit's time
is the slower rank's. A variant's ratio in a round is its step time over the plain fit's; the
table gives the median over the rounds and the min-max of the per-round ratios, with the median
ratio of process CPU time per step.

After the timed rounds one more fit of each variant counts the host syncs of its timed steps on
every rank (:func:`safetrain.testing.count_host_syncs`, not timed: it patches ``torch.Tensor``):
the callback must add one per healthy step, the read that carries the ranks' agreement.

Variants: ``plain`` (Lightning DDP alone), ``safe`` (``SafeTrainingCallback()``, default config: scan,
activation hooks, fused gradient check, the step's flags gathered from both ranks inside the one
read, a memory snapshot every 100 healthy steps). No logger (``logger=False``).

Run: ``.venv/bin/python benchmarks/ddp_lightning.py --rounds 7 --steps 50``
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch: idle OpenMP threads must not spin for ms

import argparse  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning_overhead import CNN, MODELS, Clock  # noqa: E402  (this directory: the same model as there)
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from safetrain.integrations.lightning import SafeTrainingCallback  # noqa: E402
from safetrain.testing import count_host_syncs  # noqa: E402

VARIANTS = ("plain", "safe")


class SyncCount(pl.Callback):
    """The host syncs of the steps from the ``warm``-th batch to the last, on this rank."""

    def __init__(self, warm: int) -> None:
        self.warm, self.count, self.steps, self._ctx, self._counter = warm, 0, 0, None, None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.warm and self._ctx is None:
            self._ctx = count_host_syncs()
            self._counter = self._ctx.__enter__()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._ctx is not None:
            self.count, self.steps = self._counter.count, trainer.global_step - self.warm
            self._ctx.__exit__(None, None, None)
            self._ctx = None


def one_fit(variant: str, spec: Dict[str, int], loader: DataLoader, steps: int, warm: int, count: bool) -> tuple:
    """Wall and CPU seconds per step of one fit of ``variant`` on this rank (or, with ``count``,
    the host syncs per step)."""
    probe: pl.Callback = SyncCount(warm) if count else Clock(warm)
    callbacks = [probe] + ([SafeTrainingCallback({"log": {"level": "WARNING"}})] if variant == "safe" else [])
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "safetrain-ddp-lightning-bench"),
    )
    trainer.fit(CNN(spec["channels"], spec["side"]), loader)
    if count:
        return (probe.count / max(probe.steps, 1),)
    return (probe.t1 - probe.t0) / probe.steps, (probe.c1 - probe.c0) / probe.steps


def _slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a fit is as slow as its slowest rank
    return float(t)


def measure(name: str, rounds: int, steps: int, warm: int) -> Dict[str, Any]:
    spec = MODELS[name]
    g = torch.Generator().manual_seed(0)
    n = spec["batch"] * steps * 2  # both ranks' shares (Lightning's DistributedSampler splits it)
    x = torch.randn(n, 3, spec["side"], spec["side"], generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=spec["batch"], shuffle=False)
    for v in VARIANTS:  # warm-up: first-call costs
        one_fit(v, spec, loader, warm + 2, warm, False)
    wall: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    cpu: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            w, c = one_fit(v, spec, loader, steps, warm, False)
            wall[v].append(_slowest(w))
            cpu[v].append(_slowest(c))
    syncs = {v: _slowest(one_fit(v, spec, loader, steps, warm, True)[0]) for v in VARIANTS}
    ratios = [a / b for a, b in zip(wall["safe"], wall["plain"])]
    cpu_ratios = [a / b for a, b in zip(cpu["safe"], cpu["plain"])]
    return {
        "plain_ms": statistics.median(wall["plain"]) * 1e3,
        "plain_lo": min(wall["plain"]) * 1e3,
        "plain_hi": max(wall["plain"]) * 1e3,
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "cpu": statistics.median(cpu_ratios),
        "syncs": syncs,
    }


def ranks(args: argparse.Namespace) -> int:
    """One rank's part (under ``torch.distributed.run``)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    rows = [(name, measure(name, args.rounds, args.steps, args.warm)) for name in args.models.split(",")]
    if int(os.environ["RANK"]) == 0:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(
            f"torch {torch.__version__}, lightning {pl.__version__}, 2 gloo ranks x 1 thread, "
            f"{args.rounds} rounds x {args.steps - args.warm} timed steps; load at the end: {load}"
        )
        print("| model (batch per rank) | safe / plain | plain ms/step | host syncs per step: plain, safe |")
        print("| --- | --- | --- | --- |")
        for name, m in rows:
            print(
                f"| {name} ({MODELS[name]['batch']}) | {m['ratio']:.2f}x ({m['min']:.2f}-{m['max']:.2f}), "
                f"cpu {m['cpu']:.2f}x | {m['plain_ms']:.2f} ({m['plain_lo']:.2f}-{m['plain_hi']:.2f}) | "
                f"{m['syncs']['plain']:.2f}, {m['syncs']['safe']:.2f} |",
                flush=True,
            )
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=50, help="steps per fit (the first --warm not timed)")
    p.add_argument("--warm", type=int, default=10)
    args = p.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return ranks(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__]
    return subprocess.call(cmd + (argv if argv is not None else sys.argv[1:]), env=env)


if __name__ == "__main__":
    raise SystemExit(main())
