"""Issue 23, the dual of the outcome promise: a healthy run of any shape gets no intervention.

Random healthy runs (small MLPs, tanh/ReLU/GELU with LayerNorm or BatchNorm; MSE, cross-entropy,
or a Gaussian NLL with learned variance, which goes negative; constant offsets of either sign and,
under Adam/AdamW, scales; SGD with momentum, Adam, AdamW at LRs that train; cosine or one-cycle
schedules; gradient accumulation; an ordinary noisier batch now and then) must finish with zero
anomaly events. Before, 71 of 200 such runs were interrupted: 70 aborted at their very end as
"worse than they started" (every one ending below zero) and 1 by a spike alarm. Negative
log-likelihood objectives going below zero are ordinary: "Negative loss values for
GaussianNLLLoss" (https://discuss.pytorch.org/t/negative-loss-values-for-gaussiannllloss/150823)
and "Is it normal for the NLL loss to be negative?" (PyTorch forums, the same pattern).
"""

from __future__ import annotations

import hypothesis
import pytest
from hypothesis import strategies as st

from tests.helpers.healthy import fit, interventions


@hypothesis.settings(max_examples=14, derandomize=True, deadline=None, database=None, print_blob=False)
@hypothesis.given(
    task=st.sampled_from(("mse", "ce", "nll")),
    act=st.sampled_from(("tanh", "relu", "gelu")),
    norm=st.sampled_from(("layer", "batch")),
    optimizer=st.sampled_from(("sgd", "adam", "adamw")),
    offset=st.sampled_from((0.0, -1.0, -100.0, 100.0, 3.0)),
    scale=st.sampled_from((1.0, 0.01, 100.0)),
    schedule=st.sampled_from(("none", "cosine", "onecycle")),
    accumulate=st.sampled_from((1, 1, 2, 4)),
    noisy_every=st.sampled_from((0, 7, 10)),
    seed=st.integers(0, 3),
)
def test_a_healthy_run_of_any_shape_gets_no_intervention_and_finishes(
    task, act, norm, optimizer, offset, scale, schedule, accumulate, noisy_every, seed
):
    scale = scale if optimizer != "sgd" else 1.0  # SGD's step is not scale-invariant: a x loss is a x the LR
    result, losses = fit(task, act, norm, optimizer, offset, scale, schedule, accumulate, noisy_every, 80, seed)
    assert interventions(result) == [] and result.ended == "done", (interventions(result), losses[:3], losses[-3:])


@pytest.mark.parametrize("offset", [-1.0, -100.0, 100.0])
def test_mse_with_an_offset_finishes_with_a_noisier_batch_in_ten(offset):
    """Issue 23: ``mse - 1`` trained well and was aborted at its end ("its last trained losses
    (median -0.91) are 1.07x its first"); with one noisier batch in ten it was aborted mid-run as 7
    spikes in a row. ``loss + 100`` passed, ``loss - 100`` failed. Now all finish, untouched."""
    result, losses = fit("mse", offset=offset, noisy_every=10, steps=96)
    assert interventions(result) == [] and result.ended == "done", interventions(result)
    assert losses[-1] < losses[0] and (offset > 0 or losses[-1] < 0)


def test_a_hand_written_loss_falling_from_minus_2_to_minus_5_finishes():
    """Issue 23: a hand-written objective whose values fall from -2 to -5 was aborted at its end
    (here 0.9 x MSE - 5 under Adam)."""
    result, losses = fit("mse", offset=-5.0, scale=0.9, steps=96)
    assert result.ended == "done" and interventions(result) == [], interventions(result)
    assert -2.5 < losses[0] < -1.5 and losses[-1] < -4.5, (losses[0], losses[-1])
