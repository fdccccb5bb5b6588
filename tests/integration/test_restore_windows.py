"""A restore to an old snapshot puts the loss-spike window back with the weights.

The spike window judges a loss against the recent losses of the model being trained. A restore to
an older snapshot (with ``snapshot.every`` large, the run's start) brings back a model whose loss is
the start's, but the window kept the trained model's low losses: every loss after the restore read
as a spike, the ladder climbed (skip, restore, scale_lr) and the run aborted at its start weights
(found by benchmarks/spikes.py's junk-batch scenario: all three unclipped runs aborted this way).
The window now goes back with the weights it describes, as the gradient-norm statistics do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safetrain import Guard
from safetrain.testing import WeightFault
from tests.helpers.models import loader, mlp, regression_data


def test_a_restore_to_the_start_judges_the_next_losses_against_the_start_not_the_trained_model():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cfg = {"snapshot": {"every": 1000}, "detect": {"check_weights_every": 1}, "log": {"progress": False}}
    WeightFault(opt, model[0].weight, (0, 0), steps=[60])  # after 60 updates: a NaN weight, restored to step 0
    batches = list(loader(regression_data(), batch_size=16)) * 8
    with Guard(model, opt, cfg, loss_fn=F.mse_loss) as guard:
        results = [guard.step(b) for b in batches[:100]]
    actions = [(r.step, r.action) for r in results if r.action]
    assert actions[0] == (61, "restore"), actions
    assert all(a == "restore" for _, a in actions[:1]) and len(actions) == 1, (
        f"after the restore to the start, its losses are the start's, no spike: {actions}"
    )
    losses = [r.loss for r in results]
    assert losses[-1] < losses[61] / 4, "and the run trains on from the start"
