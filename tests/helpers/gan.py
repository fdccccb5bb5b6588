"""A small GAN (two networks, two Adam optimizers) and its two losses: a step of two objectives."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gan_and_optimizers() -> tuple:
    """(``ModuleDict`` of ``g`` and ``d``, a dict of their Adam optimizers), seeded."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    d = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gan = nn.ModuleDict({"g": g, "d": d})
    betas = (0.5, 0.999)
    opts = {
        "d": torch.optim.Adam(d.parameters(), 1e-3, betas=betas),
        "g": torch.optim.Adam(g.parameters(), 1e-3, betas=betas),
    }
    return gan, opts


def d_loss(gan: nn.ModuleDict, real: torch.Tensor) -> torch.Tensor:
    """The discriminator's loss: ``real`` as real, the generator's detached samples as fake."""
    fake = gan["g"](torch.randn(len(real), 4)).detach()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    real_term = F.binary_cross_entropy_with_logits(gan["d"](real), ones)
    return real_term + F.binary_cross_entropy_with_logits(gan["d"](fake), zeros)


def g_loss(gan: nn.ModuleDict, real: torch.Tensor) -> torch.Tensor:
    """The generator's loss: its samples judged real."""
    return F.binary_cross_entropy_with_logits(gan["d"](gan["g"](torch.randn(len(real), 4))), torch.ones(len(real), 1))
