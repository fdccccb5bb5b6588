"""Sharded training (FSDP2) with safetrain: every rank detects, decides and restores together.

Two processes train one model sharded with ``torch.distributed.fsdp.fully_shard`` (on each
``Linear`` and on the root; gloo on the CPU, NCCL on GPUs): each rank holds only its shards of
the parameters, gradients and Adam state. Rank 1's copy of the data is damaged: some of its rows
hold NaN, and one holds a value that the model turns into an infinite activation while the loss
stays finite. Rank 0's data is clean. Finiteness and norms are computed on each rank's local
shards and combined inside the step's single sync, so both ranks drop the same rows, skip the
same step and restore the same snapshot. Snapshots are sharded (``snapshot.store: safetensors``
under FSDP2: one ``step-*`` directory per save, every rank writing its own shards with
``torch.distributed.checkpoint``); at the end the full (gathered) parameters are finite and the
digest printed is of the whole model and optimizer state.

Run::

    torchrun --nproc_per_node 2 examples/fsdp.py [--run-dir DIR] [--max-steps N] [--resume]

(``python examples/fsdp.py`` starts torchrun itself.) ``--max-steps 12`` then ``--resume`` stops
part-way and resumes from the sharded snapshots in new processes (bitwise equal to the
uninterrupted run). ``safetrain export DIR/snapshots model.safetensors`` then writes one full model
file that loads into the unsharded model.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from safetrain import SafeTrainer, load_config


class Spike(torch.nn.Module):
    """Identity, except that inputs above 1e30 become +inf (a data-dependent fault the loss hides)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.where(x > 1e30, 1e10, 1.0)  # only a marked value overflows


class Damaged(Dataset):
    """Rank 1's view of the data: NaN in every 41st row, a 1e31 in row 203."""

    def __init__(self, base: TensorDataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int):
        x, y = self.base[i]
        if i % 41 == 0 or i == 203:
            x = x.clone()
            x[0] = math.nan if i % 41 == 0 else 1e31
        return x, y


def train(args: argparse.Namespace, rank: int, device: torch.device) -> None:
    """Build the sharded model and loader of this rank, fit, and report (rank 0) what happened."""
    torch.manual_seed(0)  # the same data and initial weights on every rank
    x = torch.randn(512, 8)
    data = TensorDataset(x, x @ torch.randn(8, 1) + 0.05 * torch.randn(512, 1))
    model = torch.nn.Sequential(
        Spike(), torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 1),
    ).to(device)  # fmt: skip
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)  # each Linear's parameters are all-gathered for its forward only
    fully_shard(model)  # the root last: safetrain refuses a model whose root is not sharded
    torch.manual_seed(1000 + rank)  # each rank its own random stream from here on
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # SafeTrainer calls set_epoch()
    loader = DataLoader(Damaged(data) if rank == 1 else data, batch_size=16, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # after fully_shard: state is sharded
    cfg = load_config(
        None,
        [
            f"log.dir={args.run_dir}",
            "log.progress=false",
            "snapshot.store=safetensors",  # under FSDP2: sharded snapshot directories (DCP)
            "snapshot.every=5",
            "snapshot.keep=2",
            "recovery.actions.forward=restore",
        ],
    )
    trainer = SafeTrainer(model, optimizer, cfg, loss_fn=F.mse_loss)
    resume = os.path.join(args.run_dir, "snapshots") if args.resume else None
    result = trainer.fit(loader, epochs=args.epochs, max_steps=args.max_steps, resume=resume)

    # The whole model and optimizer state, gathered from the shards (a collective: every rank).
    flat = [p.full_tensor().detach().reshape(-1).cpu() for p in model.parameters()]
    finite = all(bool(torch.isfinite(t).all()) for t in flat)
    flat += [s[k].full_tensor().reshape(-1).cpu() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    digest = hashlib.sha256(torch.cat(flat).numpy().tobytes()).hexdigest()[:16]
    dropped = [None] * dist.get_world_size()
    dist.all_gather_object(dropped, result.dropped_rows)  # rows are dropped per rank
    if rank != 0:
        return
    print(
        f"{'resumed: ' if args.resume else ''}{result.steps} steps, {result.healthy_steps} healthy, "
        f"{result.skipped_batches} skipped, {result.restores} restores, rows dropped per rank {dropped}, "
        f"final loss {result.final_loss:.4f}"
    )
    for event in result.events:
        if event.name in ("anomaly", "restored"):
            ranks = event.detail.get("ranks")  # which ranks' own values tripped, per check
            tripped = f"  tripped: {ranks}" if ranks else ""
            print(f"  step {event.step}: {event.name} {event.kind} -> {event.action}{tripped}")
    snapshots = os.path.join(args.run_dir, "snapshots")
    listing = sorted(d for d in os.listdir(snapshots) if d.startswith("step-")) if os.path.isdir(snapshots) else []
    print(f"full parameters finite: {finite} (digest of model and optimizer state {digest})")
    print(f"sharded snapshots: {snapshots} {listing}")
    print(f"one model file: safetrain export {snapshots} model.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default=os.path.join(tempfile.gettempdir(), "safetrain-fsdp-example"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--resume", action="store_true", help="resume from RUN_DIR/snapshots")
    args = parser.parse_args()

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    if rank == 0 and not args.resume:
        shutil.rmtree(args.run_dir, ignore_errors=True)
    dist.barrier()
    try:
        train(args, rank, device)
    finally:
        gc.collect()  # free the sharded model (it holds the process group) before the group is destroyed
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:  # started as a plain script: launch 2 ranks with torchrun
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                os.path.abspath(__file__),
                *sys.argv[1:],
            ],
        )
    main()
