"""Overhead of safetrain on 2 gloo ranks: the Guard against a plain DDP or FSDP2 loop.

Every variant trains its own copy of the same model (``--wrap ddp``: ``DistributedDataParallel``;
``--wrap fsdp2``: ``fully_shard`` on each ``Linear``, then the root), 2 ranks on gloo, one thread per
rank, on the same fixed batches; rounds of blocks run interleaved, the order of the variants rotated
each round, each block ``--steps`` timed steps after one warm-up step. Both ranks run the same
schedule (their collectives must pair up); rank 0's clock is reported, and a block's time is the max
over ranks. A variant's ratio in a round is its median step time over the plain loop's in that
round; the table gives the median ratio with its min-max over rounds.

Variants:

* ``plain``: ``zero_grad``, forward, loss, backward (DDP's gradient all-reduce; FSDP's parameter
  all-gathers and gradient reduce-scatters), SGD step.
* ``guard``: :class:`safetrain.guard.Guard` on the wrapped model, default detection (eager hooks),
  the step's flags (under FSDP2 also the local gradient shards' norms) combined across ranks: one
  ``all_gather`` inside the one host read.
* ``guard_local``: the same guard with each rank reading only its own flags (the combination
  switched off, which is NOT safe: ranks may decide differently, and under FSDP2 each would see
  only its shards' norms); ``guard`` minus ``guard_local`` is the cost of the combination alone.

The step's collective alone is also timed: an ``all_gather_single`` of the guard's packed step
vector (its length read from the guard's first step) in a tight loop, then ``tolist()``.

Run: ``.venv/bin/python benchmarks/ddp.py [--wrap fsdp2]`` (``--help`` for rounds, steps and models).
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch: idle OpenMP threads must not spin for ms

import argparse  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from safetrain import load_config  # noqa: E402
from safetrain.detect import StepFlags  # noqa: E402
from safetrain.guard import Guard  # noqa: E402

MODELS: Dict[str, Tuple[int, int, int]] = {  # name: (width, depth, batch)
    "mlp-1M": (512, 5, 64),
    "mlp-tiny": (32, 3, 16),
}
VARIANTS = ("plain", "guard", "guard_local")


def _model(width: int, depth: int, wrap: str) -> nn.Module:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers)
    if wrap == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    for layer in layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _variant(
    name: str, width: int, depth: int, wrap: str, sizes: List[int]
) -> Callable[[Tuple[torch.Tensor, torch.Tensor]], None]:
    model = _model(width, depth, wrap)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == "plain":

        def step(batch: Tuple[torch.Tensor, torch.Tensor]) -> None:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(batch[0]), batch[1]).backward()
            opt.step()

        return step
    cfg = load_config(None, ["log.progress=false", "log.level=WARNING", "snapshot.every=1000000"])
    guard = Guard(model, opt, cfg, loss_fn=F.cross_entropy)
    if name == "guard_local":
        guard.forward.flags = StepFlags()  # per-rank read only: for measuring, never for training
    else:
        reduce = guard.sync.reduce

        def counted(packed: torch.Tensor, layout: List) -> List[float]:
            sizes.append(packed.numel())  # the length of the step's packed vector
            return reduce(packed, layout)

        guard.forward.flags._reduce = counted
    return guard.step


def _collective(n: int, repeat: int = 300) -> List[float]:
    """Seconds of one ``all_gather_single`` of ``n`` float32 values and its ``tolist()``, in a tight loop."""
    mine, out, times = torch.zeros(n), torch.empty(2 * n), []
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as the guard's sync
    for _ in range(repeat):
        dist.barrier()
        t = time.perf_counter()
        gather(out, mine)
        out.tolist()
        times.append(time.perf_counter() - t)
    return times


def _block(step: Callable, batches: List, steps: int) -> float:
    """Median seconds per step over ``steps`` timed steps (one warm-up step first)."""
    step(batches[0])
    times = []
    for i in range(steps):
        t = time.perf_counter()
        step(batches[(i + 1) % len(batches)])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _worker(rank: int, world: int, init: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    rows = []
    for model_name in args.models.split(","):
        width, depth, batch = MODELS[model_name]
        g = torch.Generator().manual_seed(rank)
        batches = [
            (torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(8)
        ]
        sizes: List[int] = []
        steps = {v: _variant(v, width, depth, args.wrap, sizes) for v in VARIANTS}
        times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for v in order:
                mine = torch.tensor([_block(steps[v], batches, args.steps)], dtype=torch.float64)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # a block is as slow as its slowest rank
                times[v].append(float(mine))
        times["collective"] = _collective(sizes[0])
        times["n"] = [float(sizes[0])]
        rows.append((model_name, times))
    if rank == 0:
        _report(rows, args)
    dist.barrier()
    dist.destroy_process_group()


def _ratio(times: Dict[str, List[float]], v: str) -> str:
    ratios = [a / b for a, b in zip(times[v], times["plain"])]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def _report(rows: List[Tuple[str, Dict[str, List[float]]]], args: argparse.Namespace) -> None:
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"{args.wrap}, 2 gloo ranks, 1 thread each, {args.rounds} rounds x {args.steps} steps, "
        f"torch {torch.__version__}"
    )
    print(f"load average at the end (1, 5, 15 min): {load}")
    print("| model | plain step | guard / plain | guard_local / plain | combination alone | the collective alone |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, times in rows:
        plain = statistics.median(times["plain"]) * 1e3
        lo, hi = min(times["plain"]) * 1e3, max(times["plain"]) * 1e3
        extra = [(a - b) * 1e6 for a, b in zip(times["guard"], times["guard_local"])]
        print(
            f"| {name} | {plain:.2f} ms ({lo:.2f}-{hi:.2f}) | {_ratio(times, 'guard')} | "
            f"{_ratio(times, 'guard_local')} | {statistics.median(extra):.0f} us "
            f"({min(extra):.0f} to {max(extra):.0f}) | {int(times['n'][0])} floats: "
            f"{statistics.median(times['collective']) * 1e6:.0f} us "
            f"(p10 {_pct(times['collective'], 0.1):.0f}, p90 {_pct(times['collective'], 0.9):.0f}) |"
        )


def _pct(values: List[float], q: float) -> float:
    """The ``q`` quantile of ``values`` in microseconds (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrap", choices=("ddp", "fsdp2"), default="ddp", help="how the model is distributed")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of interleaved blocks (default 7)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per block (default 30)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(2, f"file://{tmp}/rendezvous", args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
