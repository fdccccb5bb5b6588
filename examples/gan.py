"""A GAN under one guard: the discriminator step and the generator step of each batch, named.

One ``Guard`` over both networks (a ``ModuleDict``), their optimizers a dict and ``step_fn`` a
dict of the same names: ``guard.step(batch, name="d")`` computes the discriminator's loss and
moves its optimizer only, ``name="g"`` the generator's. Every snapshot holds both networks and both
optimizers, so a restore after a fault in either step puts them back together, at the same step.
Here the discriminator's output is poisoned once (a NaN, as a saturating discriminator gives) and
the run goes on from its last good snapshot.

Run: python examples/gan.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from safetrain import Guard, load_config


def d_loss(gan: nn.ModuleDict, real: torch.Tensor) -> torch.Tensor:
    """The discriminator's loss: real points are 1, generated ones 0 (the generator not trained)."""
    fake = gan["g"](torch.randn(len(real), 4)).detach()
    ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
    real_term = F.binary_cross_entropy_with_logits(gan["d"](real), ones)
    return real_term + F.binary_cross_entropy_with_logits(gan["d"](fake), zeros)


def g_loss(gan: nn.ModuleDict, real: torch.Tensor) -> torch.Tensor:
    """The generator's loss: its points should pass for real."""
    fake = gan["g"](torch.randn(len(real), 4))
    return F.binary_cross_entropy_with_logits(gan["d"](fake), torch.ones(len(real), 1))


def main() -> None:
    torch.manual_seed(0)
    real_data = torch.randn(64 * 60, 2) * 0.2 + torch.tensor([2.0, -1.0])  # the distribution to learn
    g = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    d = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    gan = nn.ModuleDict({"g": g, "d": d})
    optimizers = {
        "d": torch.optim.Adam(d.parameters(), lr=5e-3, betas=(0.5, 0.999)),
        "g": torch.optim.Adam(g.parameters(), lr=5e-3, betas=(0.5, 0.999)),
    }
    poison = {"on": False}
    d[0].register_forward_hook(lambda module, args, out: out * float("nan") if poison["on"] else out)
    # A GAN's losses rise and fall by design: no loss-spike or divergence judgments, no end margin
    # (and no replay of the faulty step here, to keep the example fast).
    cfg = load_config(
        None,
        ["log.progress=false", "snapshot.every=10", "recovery.actions.forward=restore", "guard.end_margin=null"]
        + ["guard.spike.enabled=false", "guard.divergence.enabled=false", "detect.replay.enabled=false"],
    )
    with Guard(gan, optimizers, cfg, step_fn={"d": d_loss, "g": g_loss}) as guard:
        guard.begin_epoch(0)
        for i, real in enumerate(real_data.split(64)):
            for name in ("d", "g"):
                poison["on"] = i == 25 and name == "d"
                result = guard.step(real, name=name)
                if result.action:
                    print(f"batch {i} {name} step: {result.action}")
    mean = g(torch.randn(1000, 4)).mean(0).tolist()
    c = guard.counts
    print(f"generated mean ({mean[0]:.2f}, {mean[1]:.2f}), target (2.00, -1.00)")
    print(f"{c.steps} steps, {c.healthy_steps} healthy, {c.restores} restores")


if __name__ == "__main__":
    main()
