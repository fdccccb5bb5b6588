"""Python calls per healthy step: ``SafeTrainer.fit`` against a plain AdamW loop (issue #34).

Counted exactly with cProfile (every Python function and every builtin or C method it calls) on
a tiny MLP (32-64-1, AdamW, a fixed synthetic data set, seed 0): the calls of a 400-step run minus
those of a 200-step run, divided by 200, so that everything done once per run (building the guard,
the first snapshot, the journal's start and end) cancels and what is left is what a step costs.
The variants:

* ``plain``: ``zero_grad``, forward, MSE loss, backward, ``step``; nothing else;
* ``fit``: ``SafeTrainer(model, opt, cfg, loss_fn=mse_loss).fit(batches)`` with the default
  configuration (``detect.mode: eager``), no progress bar, no run directory, but a snapshot every
  100 healthy steps (``snapshot.every: auto`` sets the cadence from the measured time of a
  snapshot, and so would change the count from run to run);
* ``fit_lazy``: the same with ``detect.mode=lazy`` (no activation hooks).

Then the time per step, interleaved: each round runs every variant (the order rotated each
round), each for a short and a long run, and takes the marginal time per step the same way as
the calls; a variant's ratio in a round is its marginal step over the plain loop's. Medians over
the rounds, with the min-max of the medians of 5 consecutive slices of them.

With ``--profile VARIANT`` it prints, by function, the marginal calls per step that variant makes
beyond the plain loop's (most first, then by own time), and its own time per step in each.

Run: ``.venv/bin/python benchmarks/step_calls.py [--rounds 20] [--profile fit] [--base c75cc18]``
(``--base REF``: that commit's ``fit`` and ``fit_lazy`` too, counted and timed in the same rounds).
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch: idle OpenMP threads must not spin for ms

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import safetrain  # noqa: E402

SHORT, LONG = 200, 400
VARIANTS = ["plain", "fit", "fit_lazy"]

Batches = List[Tuple[torch.Tensor, torch.Tensor]]


def make(steps: int) -> Tuple[nn.Module, torch.optim.Optimizer, Batches]:
    """The tiny MLP, its AdamW and ``steps`` batches of 16 rows, all from seed 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(steps, 16, 32), torch.randn(steps, 16, 1)
    return model, optimizer, [(x[i], y[i]) for i in range(steps)]


def plain(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches) -> None:
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


Runner = Callable[[nn.Module, torch.optim.Optimizer, Batches], None]


def fitter(mode: str, *extra: str, package: Any = safetrain) -> Runner:
    """``fit`` of ``package`` (a ``safetrain``, the working tree's by default) in ``mode``."""
    overrides = ["log.progress=false", "log.level=WARNING", f"detect.mode={mode}", *extra]

    def fit(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Batches) -> None:
        cfg = package.load_config(None, overrides)
        result = package.SafeTrainer(model, optimizer, cfg, loss_fn=F.mse_loss).fit(batches)
        if result.healthy_steps < len(batches) - 1:
            raise RuntimeError(f"the benchmark's steps were not healthy: {result}")

    return fit


RUNNERS: Dict[str, Runner] = {
    "plain": plain,
    "fit": fitter("eager", "snapshot.every=100"),
    "fit_lazy": fitter("lazy", "snapshot.every=100"),
}


def profiled(variant: str, steps: int) -> pstats.Stats:
    """cProfile's statistics of one run of ``variant`` over ``steps`` batches (set-up outside)."""
    model, optimizer, batches = make(steps)
    profile = cProfile.Profile()
    profile.enable()
    RUNNERS[variant](model, optimizer, batches)
    profile.disable()
    return pstats.Stats(profile)


def calls_per_step(variant: str) -> float:
    """The marginal Python calls a step of ``variant`` makes (exact: a deterministic count, once
    a first run has paid the one-time costs of the process)."""
    profiled(variant, 20)
    short, long = profiled(variant, SHORT), profiled(variant, LONG)
    return (long.total_calls - short.total_calls) / (LONG - SHORT)  # type: ignore[attr-defined]


def marginal(variant: str) -> Dict[str, Tuple[float, float]]:
    """``variant``'s marginal calls and own time (us) per step, by function."""
    profiled(variant, 20)
    short, long = profiled(variant, SHORT).stats, profiled(variant, LONG).stats  # type: ignore[attr-defined]
    out = {}
    for key, (_, ncalls, tottime, _, _) in long.items():
        before = short.get(key, (0, 0, 0.0, 0, 0))
        file, line, name = key
        where = f"{Path(file).name}:{line}({name})" if line else name
        out[where] = ((ncalls - before[1]) / (LONG - SHORT), (tottime - before[2]) / (LONG - SHORT) * 1e6)
    return out


def by_function(variant: str, top: int) -> List[Tuple[float, float, str]]:
    """The functions ``variant`` calls more often per step than the plain loop does: the extra
    calls and ``variant``'s own time per step, most calls first."""
    mine, base = marginal(variant), marginal("plain") if variant != "plain" else {}
    rows = []
    for where, (calls, micros) in mine.items():
        extra = calls - base.get(where, (0.0, 0.0))[0]
        if abs(extra) >= 0.005:
            rows.append((extra, micros, where))
    rows.sort(key=lambda r: (-r[0], -r[1]))
    return rows[:top]


def timed(variant: str, steps: int) -> float:
    model, optimizer, batches = make(steps)
    start = time.perf_counter()
    RUNNERS[variant](model, optimizer, batches)
    return time.perf_counter() - start


def with_base(ref: str) -> None:
    """Add ``fit@REF`` and ``fit_lazy@REF``: the ``safetrain`` of the commit ``ref`` (imported
    under its own name, as ``ab_guard.py`` does), in the same rounds as the working tree's."""
    from ab_guard import load_version  # (imports overhead.py: only when asked for)

    into = tempfile.mkdtemp(prefix="step_calls_")  # (left behind: a few hundred kB in /tmp)
    sys.path.insert(0, into)
    package = load_version("base", ref, Path(into))
    for mode, name in (("eager", "fit"), ("lazy", "fit_lazy")):
        RUNNERS[f"{name}@{ref}"] = fitter(mode, "snapshot.every=100", package=package)
        VARIANTS.append(f"{name}@{ref}")


def times(rounds: int, slices: int = 5) -> Dict[str, Tuple[float, float, float, float]]:
    """Per variant: the median marginal step (ms), and its ratio to the plain loop's (median,
    min and max of the medians of ``slices`` consecutive slices of the rounds)."""
    for v in VARIANTS:  # warm-up: first-call costs
        timed(v, 20)
    steps: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]  # rotated each round
        for v in order:
            short, long = timed(v, SHORT), timed(v, LONG)
            steps[v].append((long - short) / (LONG - SHORT))
    out = {}
    for v in VARIANTS:
        ratios = [a / b for a, b in zip(steps[v], steps["plain"])]
        size = max(1, len(ratios) // slices)
        parts = [statistics.median(ratios[i : i + size]) for i in range(0, len(ratios), size)]
        out[v] = (statistics.median(steps[v]) * 1e3, statistics.median(ratios), min(parts), max(parts))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (0: count calls only)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--profile", choices=VARIANTS, help="print this variant's calls per step by function")
    parser.add_argument("--base", help="a commit whose fit and fit_lazy run too, in the same rounds (before/after)")
    parser.add_argument("--top", type=int, default=60, help="functions listed by --profile")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.base:
        with_base(args.base)
    if args.profile:
        print(f"{args.profile}: marginal calls per step over the plain loop's, and own time per step, by function")
        for extra, micros, where in by_function(args.profile, args.top):
            print(f"{extra:8.2f} {micros:8.2f} us  {where}")
        return 0
    calls: Dict[str, float] = {v: calls_per_step(v) for v in VARIANTS}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f}")
    timed_columns = (" median step (ms) | ratio to plain |", " ---: | ---: |") if args.rounds else ("", "")
    print("| variant | calls per step | extra over plain |" + timed_columns[0])
    print("| --- | ---: | ---: |" + timed_columns[1])
    timing = times(args.rounds) if args.rounds else {}
    for v in VARIANTS:
        row = f"| {v} | {calls[v]:.1f} | {calls[v] - calls['plain']:.1f} |"
        if v in timing:
            ms, ratio, low, high = timing[v]
            row += f" {ms:.3f} | {ratio:.3f}x ({low:.2f}-{high:.2f}) |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
