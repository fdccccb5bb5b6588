"""The replay blames what made the run non-finite: not a kernel's own infinities, and at the model's line.

Issue 18, classes 6 and 8. ``F.scaled_dot_product_attention`` with a boolean mask builds
``aten.scalar_tensor(-inf)`` on the CPU and softmaxes it away: every Hugging Face model with padding
under SDPA does it on every step. The replay once took that ``-inf`` for the fault (every diagnosis
named ``sdpa_attention.py``, no fault in such a model was ever transient). And a model defined
inside an installed package (safetrain's own demo model) was reported at the console script
(``.venv/bin/safetrain:8 in <module>``) instead of its ``forward``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.cli.demo import LogNormFeatures
from safetrain.errors import TrainingAborted
from safetrain.testing import OutputFault

BASE = ["log.progress=false", "snapshot.every=1000"]


class PaddedSelfAttention(torch.nn.Module):
    """A Hugging Face-style encoder block: embeddings, SDPA with a boolean padding mask, an MLP, a head."""

    def __init__(self, vocab: int = 20, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)
        self.head = torch.nn.Linear(d, 1)

    def forward(self, batch):
        ids, keep = batch  # keep: True for a real token, False for padding
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]  # (b, 1, 1, s): every query sees the real keys, as HF's sdpa mask
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.fc2(torch.relu(self.fc1(x)))
        pooled = (x * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        return self.head(pooled).squeeze(-1)


def padded_batches(n: int = 12, b: int = 8, s: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 20, (b, s), generator=g)
        lengths = torch.randint(2, s + 1, (b,), generator=g)
        keep = torch.arange(s)[None, :] < lengths[:, None]
        ids = ids.masked_fill(~keep, 0)
        out.append(((ids, keep), ids.float().mean(1) / 10))
    return out


def fit_attention(calls, overrides=()):
    torch.manual_seed(0)
    model = PaddedSelfAttention()
    if calls is not None:
        OutputFault(model.fc1, calls=calls)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = load_config(None, [*BASE, "recovery.max_retries=3", *overrides])
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss)
    try:
        result = trainer.fit(padded_batches(), epochs=1)
    except TrainingAborted as exc:
        result = exc.result  # type: ignore[attr-defined]
    return model, result


def test_sdpa_boolean_mask_makes_an_internal_inf_the_replay_must_not_blame():
    """The premise: SDPA's own ``-inf`` is an op with finite inputs and a non-finite output."""
    from safetrain.diagnose.nonfinite import first_nonfinite_op

    q = torch.randn(2, 1, 4, 8)
    keep = torch.tensor([[True, True, False, False], [True, True, True, True]])[:, None, None, :]
    with first_nonfinite_op() as mode:
        out = F.scaled_dot_product_attention(q, q, q, attn_mask=keep)
    assert torch.isfinite(out).all()
    assert mode.op is not None, "the kernel made an inf inside (if not, this torch no longer needs the rule)"
    assert mode.culprit([out]) is None, mode.candidates


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_one_shot_fault_in_a_padded_sdpa_model_is_transient_and_names_the_linear(mode):
    """Issue 18 class 8: a one-shot fault in a model with SDPA and a padding mask is found transient
    (retried once, training goes on), and the diagnosis names the faulty Linear, not sdpa."""
    model, result = fit_attention(calls=[5], overrides=[f"detect.mode={mode}"])
    anomalies = [e for e in result.events if e.name == "anomaly"]
    assert len(anomalies) == 1, [e.message for e in anomalies]
    d = anomalies[0].detail["diagnosis"]
    assert d["reproducible"] is False, d
    assert anomalies[0].action == "retry", anomalies[0].action
    assert not result.aborted and result.steps == 12 and result.retries == 1, result.summary()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert "scaled_dot_product" not in str(d) and "scalar_tensor" not in str(d), d


def test_persistent_fault_in_a_padded_sdpa_model_is_reproducible_at_the_linear():
    _, result = fit_attention(calls=range(5, 10_000), overrides=["detect.mode=lazy"])
    d = next(e for e in result.events if e.name == "anomaly").detail["diagnosis"]
    assert d["reproducible"] is True, d
    assert d["module"] == "fc1", d
    assert "scalar_tensor" not in str(d.get("op")), d


def test_healthy_padded_sdpa_model_has_no_anomaly():
    model, result = fit_attention(calls=None)
    assert [e.message for e in result.events if e.name == "anomaly"] == []
    assert not result.aborted and result.healthy_steps == 12, result.summary()


def test_explicit_look_at_a_healthy_sdpa_step_is_transient():
    """``Guard.diagnose`` on a step that did not trip: the replay finds nothing (the kernel's -inf is not a fault)."""
    from safetrain.guard import Guard

    torch.manual_seed(0)
    model = PaddedSelfAttention()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = padded_batches(1)[0]
    with Guard(model, opt, load_config(None, BASE), loss_fn=F.mse_loss) as guard:
        guard.step(batch)
        d = guard.diagnose()
    assert d.reproducible is False and d.op is None, d


def test_a_model_defined_in_an_installed_package_is_named_at_its_forward():
    """Issue 18 class 6: safetrain's demo model (``LogNormFeatures``: ``log(|x|^2)``, ``-inf`` for an
    all-zero row) lives inside the package; the line is its ``forward``, and the caller is named too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(LogNormFeatures(), torch.nn.Linear(9, 1))
    x = torch.randn(8, 8)
    x[3] = 0.0
    batches = [(torch.randn(8, 8), torch.randn(8, 1)), (x, torch.randn(8, 1))]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = load_config(None, [*BASE, "detect.mode=lazy", "sanitize.inputs=off"])
    try:
        result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(batches)
    except TrainingAborted as stop:  # its one trained step given back: a run left at its start (issue 32)
        result = stop.result
    d = next(e for e in result.events if e.name == "anomaly").detail["diagnosis"]
    line = inspect.getsourcelines(LogNormFeatures.forward)[1] + 1  # the line of the log
    assert d["op"] == "aten.log.default", d
    assert d["op_line"] == f"{inspect.getsourcefile(LogNormFeatures)}:{line} in forward", d
    assert d["op_caller"] is not None and "test_replay_blame.py" in d["op_caller"], d


class BagOfWords(torch.nn.Module):
    """Embeddings of which rows 10..19 are never looked up: their gradient rows are always zero."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(20, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1)).squeeze(-1)


@pytest.mark.parametrize("foreach", [False, True])
def test_an_update_is_named_by_the_optimizer_and_its_hyperparameters(foreach):
    """Issue 18 classes 4 and 6: Adam with ``eps=0`` on rows whose gradient is always zero makes
    ``0 / (sqrt(0) + 0)`` = NaN in the update. The weight replay's line is the optimizer and its
    hyperparameters (``Adam(... eps=0 ...)``), not the script that called ``fit``."""
    torch.manual_seed(0)
    model = BagOfWords()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, foreach=foreach)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 10, (8, 5), generator=g), torch.randn(8, generator=g)) for _ in range(6)]
    cfg = load_config(None, [*BASE, "detect.check_weights_every=1", "recovery.max_retries=2"])
    try:
        result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(batches)
    except TrainingAborted as exc:
        result = exc.result  # type: ignore[attr-defined]
    event = next(e for e in result.events if e.name == "anomaly")
    d = event.detail["diagnosis"]
    assert d["kind"] == "weights" and d["weights_step"] == 1 and "embed.weight" in d["nonfinite_weights"], d
    assert "addcdiv" in d["op"], d
    assert d["op_line"].startswith("Adam(lr=0.001, betas=(0.9, 0.999), eps=0, "), d
    assert "test_replay_blame.py" not in d["op_line"], "not the script that called fit"
    assert "Adam(lr=0.001, betas=(0.9, 0.999), eps=0, " in event.message, event.message
