"""The cause test (issue 32): a bad batch, a damaged model, data that changed, and a schedule's peak.

Each scenario is a small MLP through ``SafeTrainer.fit`` with the default configuration
(``cause``) and with ``recovery.cause_test=false`` (``ladder``: the behaviour before the test),
over ``--seeds``, ``--steps`` steps each, the fault at ``--at``:

- ``bad_batch``: regression; one batch's targets x1000 (finite): a spike the next batch clears;
- ``damage``: regression through a running normaliser (a buffer read in the forward); a
  calibration pass on a garbage batch leaves +1 in its buffer (finite; no step's loss a spike:
  the loss rises to a plateau and stays);
- ``data_change``: 4 classes, then 4 new ones (class-incremental): the loss jumps ~50x and stays;
- ``peak``: regression under SGD with a one-cycle schedule whose peak LR is too high (diverges
  near the peak).

Per (scenario, variant): restores, steps lost to restores (the steps between each restored
snapshot and the restore), batches skipped, level shifts, how the runs ended, and the end level
(lower quartile of the last 16 trained losses, median over seeds) against the same run without
the fault (``clean``; for ``peak`` the same schedule with a peak 10x lower). Then the cost: the
cause test's time per call against the median step time (on anomalies only), and healthy runs
(the clean runs) with the test on against off, interleaved (median of per-pair time ratios;
noisy on a shared machine).

Run: ``GOMP_SPINCOUNT=10000 .venv/bin/python benchmarks/causes.py``
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch is imported (a shared machine)

import argparse  # noqa: E402
import logging  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Dict, List, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from safetrain import SafeTrainer, TrainingAborted, load_config  # noqa: E402
from safetrain.diagnose import cause_test  # noqa: E402

ROWS = 32
CALLS: List[float] = []  # the cause test's wall time per call


def _timed(run: Any) -> Any:
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            CALLS.append(time.perf_counter() - t)

    return wrapper


cause_test.CauseTest.run = _timed(cause_test.CauseTest.run)  # type: ignore[method-assign]


class RunningNorm(torch.nn.Module):
    """Inputs minus a running mean kept in a buffer, read in the forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(x - self.mean)
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.99).add_(0.01 * x.mean(0))
        return out


def _data(scenario: str, seed: int, steps: int, at: int, fault: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS * steps, 8, generator=g)
    if scenario == "data_change":
        old, new = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
        y = (x @ old).argmax(1)
        if fault:
            y[at * ROWS :] = (x[at * ROWS :] @ new).argmax(1) + 4
        return x, y
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(ROWS * steps, 1, generator=g)
    if scenario == "bad_batch" and fault:
        y[at * ROWS : (at + 1) * ROWS] *= 1000.0
    return x, y


def run(scenario: str, variant: str, seed: int, steps: int, at: int, fault: bool) -> Dict[str, Any]:
    """One run; its outcome."""
    x, y = _data(scenario, seed, steps, at, fault)
    torch.manual_seed(seed)
    out = 8 if scenario == "data_change" else 1
    layers: List[torch.nn.Module] = [RunningNorm(8)] if scenario == "damage" else []
    model = torch.nn.Sequential(*layers, torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, out))
    scheduler = None
    if scenario == "peak":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        peak = 1.5 if fault else 0.15
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=peak, total_steps=steps + 1)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses: List[float] = []
    calls = [0]
    base = F.cross_entropy if scenario == "data_change" else F.mse_loss

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = base(output, target)
        if torch.is_grad_enabled():
            losses.append(loss.item())
            calls[0] += 1
            if scenario == "damage" and fault and calls[0] == at:
                with torch.no_grad():
                    model[0].mean.add_(1.0)
        return loss

    over = ["log.progress=false"] + (["recovery.cause_test=false"] if variant == "ladder" else [])
    cfg = load_config(None, over)
    started = time.perf_counter()
    try:
        result = SafeTrainer(model, opt, cfg, loss_fn=loss_fn, scheduler=scheduler).fit(
            DataLoader(TensorDataset(x, y), batch_size=ROWS)
        )
    except TrainingAborted as e:
        result = e.result
    wall = time.perf_counter() - started
    restored = [e for e in result.events if e.name == "restored" and "snapshot_step" in e.detail]
    tail = sorted(losses[-16:])
    return {
        "restores": result.restores,
        "lost": sum(e.step - e.detail["snapshot_step"] for e in restored),
        "skipped": result.skipped_batches,
        "shifts": sum(e.kind == "level_shift" for e in result.events),
        "ended": result.ended,
        "end": tail[len(tail) // 4] if tail else float("nan"),
        "step_s": wall / max(1, result.steps),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=220)
    parser.add_argument("--at", type=int, default=150)
    args = parser.parse_args()
    logging.getLogger("safetrain").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    rows = []
    step_times: List[float] = []
    healthy: List[float] = []
    for scenario in ("bad_batch", "damage", "data_change", "peak"):
        clean = [run(scenario, "cause", s, args.steps, args.at, fault=False) for s in range(args.seeds)]
        clean_off = [run(scenario, "ladder", s, args.steps, args.at, fault=False) for s in range(args.seeds)]
        healthy += [a["wall"] / b["wall"] for a, b in zip(clean, clean_off)]
        step_times += [c["step_s"] for c in clean]
        for variant in ("cause", "ladder"):
            got = [run(scenario, variant, s, args.steps, args.at, fault=True) for s in range(args.seeds)]
            ratio = statistics.median(g["end"] / c["end"] for g, c in zip(got, clean))
            ended = ", ".join(sorted({g["ended"] for g in got}))
            rows.append(
                f"| {scenario} | {variant} | {sum(g['restores'] for g in got)} | {sum(g['lost'] for g in got)} | "
                f"{sum(g['skipped'] for g in got)} | {sum(g['shifts'] for g in got)} | {ended} | "
                f"{statistics.median(g['end'] for g in got):.3g} | {ratio:.2f} |"
            )
    print(f"{args.seeds} seeds x {args.steps} steps, fault at step {args.at}; totals over seeds, end level median\n")
    print(
        "| scenario | variant | restores | steps lost to restores | skipped | level shifts | ended | end level "
        "| end / clean |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    step = statistics.median(step_times)
    if CALLS:
        per = statistics.median(CALLS)
        print(f"\ncause test: {len(CALLS)} calls, median {per * 1e3:.2f} ms = {per / step:.1f} healthy steps each")
    print(f"healthy runs, test on / off (interleaved pairs): median time ratio {statistics.median(healthy):.3f}")


if __name__ == "__main__":
    main()
