"""Resume after a crash: safetensors snapshots on disk, a process killed mid-run, ``fit(..., resume=dir)``.

With ``snapshot.store: safetensors`` every snapshot is a file written atomically (temporary
file, fsync, rename), so a kill at any moment leaves the last complete one. Here a child
process trains and is killed (SIGKILL, no clean-up) part-way through; the parent then resumes
from the snapshot directory: model, optimizer, RNG, counters and the position in the epoch come
back, and the run finishes as if nothing had happened. An uninterrupted run gives the reference.

Run: python examples/resume.py [RUN_DIR]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from safetrain import SafeTrainer, load_config
from safetrain.snapshot import inspect_snapshot, list_snapshots

EPOCHS, KILL_AT = 3, 70  # 32 batches per epoch; the child dies in the middle of epoch 2


class KillAt:
    """Yields the loader's batches and kills this process, without any clean-up, at batch ``at``."""

    def __init__(self, loader: DataLoader, at: Optional[int]) -> None:
        self.loader, self.at = loader, at

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.loader:
            self.at = None if self.at is None else self.at - 1
            if self.at == 0:
                os.kill(os.getpid(), signal.SIGKILL) if hasattr(signal, "SIGKILL") else os._exit(137)
            yield batch


def make(run_dir: Optional[Path]) -> Tuple[torch.nn.Module, SafeTrainer, DataLoader]:
    torch.manual_seed(0)
    x = torch.randn(1024, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(1024, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)  # shuffled from the global RNG
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    overrides = ["log.progress=false", "snapshot.every=10"]
    if run_dir is not None:
        overrides += ["snapshot.store=safetensors", f"log.dir={run_dir}"]
    cfg = load_config(None, overrides)
    return model, SafeTrainer(model, optimizer, cfg, loss_fn=F.mse_loss), loader


def child(run_dir: Path) -> None:
    _, trainer, loader = make(run_dir)
    trainer.fit(KillAt(loader, KILL_AT), epochs=EPOCHS)


def main(run_dir: Path) -> None:
    print(f"run directory: {run_dir}")
    proc = subprocess.run([sys.executable, __file__, "--child", str(run_dir)])
    print(f"child process ended with {proc.returncode} (killed at batch {KILL_AT})")
    snapshots = list_snapshots(run_dir / "snapshots")
    if not snapshots:
        raise SystemExit("no snapshot was written; nothing to resume from")
    info = inspect_snapshot(snapshots[-1])
    print(
        f"newest snapshot: {Path(snapshots[-1]).name} (step {info['step']}, epoch {info['epoch']}, "
        f"batch {info['batch']}, finite: {info['all_finite']})"
    )

    model, trainer, loader = make(run_dir)
    result = trainer.fit(loader, epochs=EPOCHS, resume=run_dir / "snapshots")
    print(f"resumed: finished at step {result.steps}, final loss {result.final_loss:.4f}")

    reference, ref_trainer, ref_loader = make(None)
    ref = ref_trainer.fit(ref_loader, epochs=EPOCHS)
    gap = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    print(
        f"uninterrupted run: {ref.steps} steps, final loss {ref.final_loss:.4f}; "
        f"largest weight difference after resume: {gap:.2e}"
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
    elif len(sys.argv) == 2:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp) / "run")
