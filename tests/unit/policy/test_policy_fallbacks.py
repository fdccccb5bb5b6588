"""The policy with no snapshot to restore, as a table: (kind, ladder, history) -> (action, restore). No torch.

A restore requested while the store holds nothing usable (none taken yet, or every snapshot
refused as non-finite) used to surface as the store's internal ``SnapshotError`` out of ``fit``
(issue 23, point 3). It is the policy's decision, from the typed fact ``History.has_snapshot``.
"""

from __future__ import annotations

import pytest

from safetrain import load_config
from safetrain.policy import Anomaly, History, Rules, decide

ROWS = [
    # (name, overrides, kind, rungs before, has_snapshot, expected action, restores, in the reason)
    ("restore with a snapshot restores", [], "weights", 0, True, "restore", True, "first action"),
    ("weights without a snapshot abort", [], "weights", 0, False, "abort", False, "no usable snapshot"),
    ("weights at scale_lr without a snapshot abort", [], "weights", 2, False, "abort", False, "no usable snapshot"),
    ("loss at restore falls back to skip_batch", [], "loss", 1, False, "skip_batch", False, "skipped instead"),
    ("loss at scale_lr backs off without a restore", [], "loss", 2, False, "scale_lr", False, "without a restore"),
    ("loss at scale_lr with a snapshot restores", [], "loss", 2, True, "scale_lr", True, "escalated"),
    ("the first action skip_batch is untouched", [], "loss", 0, False, "skip_batch", False, "first action"),
    ("spike restore falls back", ["recovery.actions.spike=restore"], "spike", 0, False, "skip_batch", False, "instead"),
    ("gradient zero_grads is untouched", [], "gradient", 0, False, "zero_grads", False, "first action"),
    ("abort at max_retries stays abort", ["recovery.max_retries=0"], "loss", 1, False, "abort", False, "max_retries"),
]


@pytest.mark.parametrize("name,overrides,kind,before,has,action,restores,why", ROWS, ids=[r[0] for r in ROWS])
def test_a_restore_without_a_snapshot_is_a_decision(name, overrides, kind, before, has, action, restores, why):
    cfg = load_config(None, list(overrides))
    decision, after = decide(Anomaly(kind), History(consecutive=before, has_snapshot=has), Rules.of(cfg))
    assert (decision.action, decision.restore) == (action, restores), (name, decision)
    assert why in decision.reason, decision.reason
    assert after.restored == restores, "a restore is remembered only when one is carried out"
    if not has:
        assert not decision.pass_over_newest


def test_the_fallback_counts_toward_the_skip_fraction_and_the_ladder_goes_on():
    """A restore turned into skip_batch is still an untrained step on the ladder: the run cannot
    reach its end by skipping, and max_retries still ends it."""
    cfg = load_config(None, ["recovery.max_retries=3"])
    history, actions = History(has_snapshot=False), []
    for _ in range(5):
        decision, history = decide(Anomaly("loss"), history, Rules.of(cfg))
        actions.append(str(decision.action))
        if decision.action == "abort":
            break
    assert actions == ["skip_batch", "skip_batch", "scale_lr", "scale_lr", "abort"], actions
    assert sum(history.recent) == len(actions)


def test_has_snapshot_is_not_part_of_a_snapshot():
    assert "has_snapshot" not in History(has_snapshot=False).to_dict()
    assert History.from_dict(History(has_snapshot=False).to_dict()).has_snapshot
