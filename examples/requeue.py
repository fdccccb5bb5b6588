"""A requeueable training job: SIGTERM stops it cleanly, the next start of the same command resumes.

Job schedulers send SIGTERM some seconds before they kill a job (SLURM at preemption or
``--signal``, Kubernetes at pod eviction, cloud spot instances at reclaim). While ``fit`` runs,
safetrain catches it, finishes the current step, snapshots it (``snapshot.on_signal``), closes the
journal with ``interrupted`` and raises ``TrainingInterrupted``. This script then exits with
status 143 (128 + SIGTERM), which tells the scheduler to start it again; started again, the same
command finds the snapshot (``resume="auto"``) and continues from that step, ending exactly as an
uninterrupted run would. A first start (no snapshot yet) trains from scratch.

Run: python examples/requeue.py RUN_DIR [--pace SECONDS] [--save FILE]

    --pace S   sleep S seconds per batch and print each step (to send a signal mid-run by hand)
    --save F   write the final parameters to F (safetensors), to compare runs

SLURM (``sbatch --requeue --signal=B:TERM@120 job.sh``), job.sh::

    python examples/requeue.py runs/job-$SLURM_JOB_ID || { [ $? -eq 143 ] && scontrol requeue $SLURM_JOB_ID; }

Kubernetes: a Job with ``restartPolicy: OnFailure`` and ``terminationGracePeriodSeconds`` longer
than one step plus one snapshot; RUN_DIR on a persistent volume.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import SafeTrainer, TrainingInterrupted, load_config

EPOCHS = 3


class Paced:
    """The loader's batches, each after a pause, printing how many steps were taken so far."""

    def __init__(self, loader: DataLoader, pace: float, trainer: SafeTrainer) -> None:
        self.loader, self.pace, self.trainer = loader, pace, trainer

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            guard = self.trainer.guard
            print(f"step {guard.steps if guard else 0}", flush=True)
            time.sleep(self.pace)
            yield batch


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1) + 0.1 * torch.randn(256, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # shuffled from the global RNG
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = load_config(
        None,
        ["log.progress=false", "snapshot.store=safetensors", "snapshot.every=10", f"log.dir={args.run_dir}"],
    )
    trainer = SafeTrainer(model, optimizer, cfg, loss_fn=F.mse_loss)
    data = Paced(loader, args.pace, trainer) if args.pace > 0 else loader
    try:
        result = trainer.fit(data, epochs=EPOCHS, resume="auto")  # a snapshot there: go on from it
    except TrainingInterrupted as exc:  # Ctrl-C too: then a TrainingKeyboardInterrupt, a KeyboardInterrupt as well
        print(f"interrupted: {exc}", flush=True)
        return 128 + int(exc.signal or 15)  # 143 for SIGTERM: the scheduler's cue to start this same command again
    if args.save:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.save)
    print(f"done: {result.steps} steps, final loss {result.final_loss:.4g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
