"""What the Lightning tests build: a tiny CNN ``LightningModule`` on 8x8 images (4 classes), its
loader, a CPU ``pl.Trainer`` and a logger that keeps what it is given."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from safetrain.integrations.lightning import SafeTrainingCallback

CFG: Dict[str, Any] = {"snapshot": {"every": 5}, "detect": {"check_weights_every": 0}, "log": {"level": "WARNING"}}


class Net(pl.LightningModule):
    """A tiny CNN with BatchNorm on 8x8 single-channel images, 4 classes."""

    def __init__(self, lr: float = 0.05, sched: Optional[str] = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 4 * 4, 4)
        self.lr, self.sched, self.keep = lr, sched, False
        self.seen: List[float] = []  # the losses training_step computed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.head(h.flatten(1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        if self.keep:
            self.seen.append(float(loss))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if self.sched is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Collect(Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: List[tuple] = []

    @property
    def name(self) -> str:
        return "collect"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        self.rows.append((step, dict(metrics)))


def images(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()
    return TensorDataset(x, y)


def loader(data: Any = None, batch_size: int = 8) -> DataLoader:
    return DataLoader(data if data is not None else images(), batch_size=batch_size, shuffle=False)


def trainer(cb: Optional[SafeTrainingCallback], tmp: Path, max_steps: int = 8, **kw: Any) -> pl.Trainer:
    opts = dict(enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp),
        callbacks=[cb] if cb is not None else [],
        **{**opts, **kw},
    )
