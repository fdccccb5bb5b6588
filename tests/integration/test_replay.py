"""Diagnosis by replay: the layer, the op and line, transient or reproducible, the bad rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.errors import TrainingAborted
from safetrain.guard import Guard
from safetrain.testing import OutputFault
from tests.helpers.models import finite_params, loader, mlp, regression_data

LAZY = ["log.progress=false", "detect.mode=lazy", "snapshot.every=1000", "recovery.max_retries=9"]


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Conv2d(8, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
        )
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


MODELS = {
    # name: (factory, input shape, name of the layer to poison)
    "mlp": (
        lambda: torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        ),
        (8,),
        "2",
    ),
    "cnn": (CNN, (3, 8, 8), "features.4"),
    "transformer": (Encoder, (5, 16), "encoder.layers.1.linear1"),
}


def classification(shape, n=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, *shape, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n // 8)]


@pytest.mark.parametrize("name", list(MODELS))
def test_lazy_mode_names_the_poisoned_layer_by_replay(name, device):
    factory, shape, target = MODELS[name]
    torch.manual_seed(0)
    model = factory().to(device)
    OutputFault(model.get_submodule(target), calls=range(3, 10_000))  # deterministic from the 3rd call on
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = load_config(
        None,
        [
            *LAZY,
            "recovery.actions.forward=skip_batch",
            "recovery.actions.loss=skip_batch",
            "recovery.escalate=[skip_batch]",
        ],
    )
    with pytest.raises(TrainingAborted, match="restored to its start"):  # every step from the 3rd on faults
        trainer = SafeTrainer(model, opt, cfg, loss_fn=F.cross_entropy)
        trainer.fit(classification(shape), epochs=1)
    event = next(e for e in trainer.guard.bus.events if e.name == "anomaly")
    assert event.kind == "loss", "lazy mode has no hooks: the loss trips first"
    diagnosis = event.detail["diagnosis"]
    assert diagnosis["reproducible"] is True
    assert diagnosis["module"] == target, diagnosis
    assert finite_params(model)


def test_log_of_zero_in_the_loss_names_the_op_and_the_user_line():
    def risky_loss(out, target):
        probs = torch.softmax(out, dim=1) * (target != 2).float().unsqueeze(1)  # a class whose probs are zeroed
        return -torch.log(probs.gather(1, target.unsqueeze(1))).mean()  # log(0) for class 2

    torch.manual_seed(0)
    model = mlp(d=8, hidden=16)
    model[2] = torch.nn.Linear(16, 3)
    batches = [(torch.randn(8, 8), torch.tensor([0, 1, 0, 1, 0, 1, 0, 1]))] * 2
    batches.insert(1, (torch.randn(8, 8), torch.tensor([0, 1, 2, 1, 0, 1, 0, 1])))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    result = SafeTrainer(model, opt, load_config(None, LAZY), loss_fn=risky_loss).fit(batches)
    event = next(e for e in result.events if e.name == "anomaly")
    d = event.detail["diagnosis"]
    assert d["reproducible"] and d["op"] == "aten.log.default", d
    assert d["op_line"].endswith("in risky_loss") and "test_replay.py" in d["op_line"], d
    assert d["bad_rows"] == [2], "bisection finds the row with target 2"
    assert "; replay: reproducible: op aten.log.default at " in event.message, "the journal line says it too"


def test_uninitialised_memory_is_not_blamed_for_a_nan():
    """``empty_like`` returns whatever bits the allocator reused, NaN included (CI once replayed a
    healthy CNN step as "reproducible: aten.empty_like"). The op's output must not count, and an
    ``out=`` buffer is written by the op, not read. The allocator is made deterministic here by an
    op that behaves like ``empty_like`` on recycled NaN memory."""
    from safetrain.diagnose.nonfinite import first_nonfinite_op

    x = torch.ones(4)
    recycled = torch.full_like(x, math.nan)  # made outside the mode

    class RecycledEmpty:
        overloadpacket = torch.ops.aten.empty_like

        def __call__(self, x, **kwargs):
            return recycled

    with first_nonfinite_op() as mode:
        buf = mode.__torch_dispatch__(RecycledEmpty(), (), (x,))
        torch.add(x, x, out=buf)  # fills the buffer: finite
        torch.log(x - 1.0)  # log(0) = -inf: the first real non-finite op
    assert torch.isfinite(buf).all()
    assert mode.op == "aten.log.default", mode.op


def test_one_call_fault_is_transient_and_deterministic_fault_reproducible():
    transient = mlp()
    OutputFault(transient[1], calls=[4])
    persistent = mlp()
    OutputFault(persistent[1], calls=range(4, 10_000))
    verdicts = {}
    for name, model in (("transient", transient), ("persistent", persistent)):
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        cfg = load_config(None, [*LAZY, "recovery.max_retries=1"])
        try:
            result = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data()), max_steps=8)
            events = result.events
        except Exception as exc:  # the persistent one aborts
            events = exc.result.events  # type: ignore[attr-defined]
        first = next(e for e in events if e.name == "anomaly")
        verdicts[name] = (first.action, first.detail["diagnosis"]["reproducible"])
    assert verdicts == {"transient": ("retry", False), "persistent": ("skip_batch", True)}


def _diagnose_rows(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    try:
        result = SafeTrainer(model, opt, load_config(None, LAZY), loss_fn=F.mse_loss).fit([(x, y)])
    except TrainingAborted as exc:  # its one step skipped: a run that trained nothing aborts (issue 18)
        result = exc.result  # type: ignore[attr-defined]
    return next(e for e in result.events if e.name == "anomaly").detail["diagnosis"]


@pytest.mark.parametrize(
    "rows, max_passes",
    [
        ([5, 41], 2 * math.log2(64) + 2),  # the case: the train-mode replay stands for the first test
        ([63], math.log2(64) + 1),  # every left half clean: the row reached is tested once to be sure
        ([0], math.log2(64) + 1),
        ([1, 20, 50], 3 * math.log2(64) + 3),
    ],
)
def test_bisection_finds_exactly_the_poisoned_rows_and_counts_passes(rows, max_passes):
    torch.manual_seed(0)
    x, y = regression_data(n=64).tensors
    y = y.clone()
    y[rows] = 3e38  # finite targets whose squared error overflows: the sanitizer cannot see them
    d = _diagnose_rows(mlp(), x, y)
    assert d["bad_rows"] == rows
    assert 0 < d["forward_passes"] <= max_passes, d["forward_passes"]


def test_bisection_reports_no_row_when_the_batch_is_bad_in_train_mode_only():
    """Batch statistics without eps on a feature that is constant over the batch: 0/0 in train mode,
    finite in eval mode (where the bisection runs). The first search infers its way to the last row
    without one bad test; that row is checked, and not reported."""

    class BatchWhiten(torch.nn.Module):  # BatchNorm with eps=0 (which torch refuses) and no running stats
        def forward(self, x):
            return (x - x.mean(0)) / x.std(0) if self.training else x

    torch.manual_seed(0)
    model = torch.nn.Sequential(BatchWhiten(), torch.nn.Linear(8, 1))
    x, y = regression_data(n=64).tensors
    x = x.clone()
    x[:, 3] = 1.0
    d = _diagnose_rows(model, x, y)
    assert d["reproducible"] is True and d["bad_rows"] == [], d
    assert "not per-sample separable" in d["note"]
    assert d["forward_passes"] == math.log2(64) + 1


@pytest.mark.parametrize("bad", [set(), {0}, {63}, {5, 41}, {1, 20, 50}, set(range(64))])
def test_bad_rows_table(bad):
    from safetrain.diagnose.bisect import bisect_rows

    calls = []

    def test(rows):
        calls.append(len(rows))
        return bool(bad & set(rows))

    found = bisect_rows(64, test)
    assert found == (sorted(bad) if bad else []), found
    assert 64 not in calls, "the whole batch is never tested again"
    assert len(calls) <= (len(bad) + 1) * math.log2(64) + 1, (bad, len(calls))


def test_in_place_ops_that_poison_their_own_input_are_named():
    from safetrain.diagnose.nonfinite import first_nonfinite_op

    x = torch.ones(3)
    with first_nonfinite_op() as mode:
        x.mul_(1e30)  # finite
        x.mul_(1e30)  # overflows into x itself
    assert mode.op is not None and mode.op.startswith("aten.mul_."), mode.op
    assert "test_replay.py" in mode.line, mode.line

    p, a, b = [torch.ones(2)], [torch.ones(2)], [torch.zeros(2)]
    with first_nonfinite_op() as mode:
        torch._foreach_addcdiv_(p, a, b, value=1.0)  # 1/0: inf written into p itself
    assert mode.op is not None and mode.op.startswith("aten._foreach_addcdiv_"), mode.op

    model = torch.nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=math.inf, foreach=True)
    with first_nonfinite_op() as mode:
        opt.step()
    assert mode.op is not None and mode.op.startswith("aten._foreach_add_"), mode.op

    y = torch.full((2,), math.nan)
    with first_nonfinite_op() as mode:
        y.add_(1.0)  # already NaN: not this op's doing
    assert mode.op is None


def test_nonfinite_reads_the_host_once_for_many_tensors():
    from safetrain.diagnose.nonfinite import any_nonfinite
    from safetrain.testing import count_host_syncs

    tensors = [torch.ones(3) for _ in range(10)] + [torch.tensor([1.0, math.nan])]
    with count_host_syncs() as syncs:
        assert any_nonfinite(tensors) is True
        assert any_nonfinite(tensors[:10]) is False
    assert syncs.count == 2, syncs


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_replay_leaves_training_bitwise_unchanged(mode):
    def run(replay_at):
        torch.manual_seed(3)
        model = CNN()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        cfg = load_config(None, ["log.progress=false", f"detect.mode={mode}", "guard.accumulate_steps=2"])
        data = classification((3, 8, 8), n=48, seed=1)
        diagnoses = []
        with Guard(model, opt, cfg, loss_fn=F.cross_entropy) as guard:
            for i, batch in enumerate(data):
                guard.step(batch)
                if i == replay_at:  # between the two micro-batches of a healthy step
                    diagnoses.append(guard.diagnose())
        return model, torch.get_rng_state(), diagnoses

    plain_model, plain_rng, _ = run(replay_at=-1)
    model, rng, diagnoses = run(replay_at=2)
    assert diagnoses and diagnoses[0].reproducible is False, "a healthy step replays finite"
    for (name, a), b in zip(plain_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(plain_rng, rng)


def test_replay_budget_is_respected():
    model = mlp()
    OutputFault(model[1], calls=range(2, 10_000))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(
        None, [*LAZY, "detect.replay.max_per_run=2", "recovery.escalate=[skip_batch]", "recovery.max_skip_fraction=1.0"]
    )
    trainer = SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss)
    with pytest.raises(TrainingAborted, match="restored to its start"):  # every step from the 2nd on faults
        trainer.fit(loader(regression_data()), max_steps=6)
    replays = [e for e in trainer.guard.bus.events if e.name == "anomaly" and "diagnosis" in e.detail]
    assert len(replays) == 2


def test_isolated_samples_are_quarantined_and_skipped_in_later_epochs_and_after_resume(tmp_path):
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from safetrain.diagnose.quarantine import QuarantineSampler, read_quarantine

    x, y = regression_data(n=64).tensors
    y = y.clone()
    y[13] = 3e38  # finite, but its squared error overflows: only a replay can find it

    def run(epochs, resume=None):
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        sampler = QuarantineSampler(RandomSampler(TensorDataset(x, y), generator=torch.Generator().manual_seed(0)))
        data = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler)
        cfg = load_config(None, [*LAZY, f"log.dir={tmp_path}"])
        return SafeTrainer(model, opt, cfg, loss_fn=F.mse_loss).fit(data, epochs=epochs, resume=resume), model

    result, model = run(epochs=3)
    anomaly = next(e for e in result.events if e.name == "anomaly")
    assert anomaly.detail["diagnosis"]["dataset_indices"] == [13]
    q = [(e.action, e.detail) for e in result.events if e.name == "quarantine"]
    assert q[0] == ("add", {"indices": [13], "file": str(tmp_path / "quarantine.json")})
    assert [a for a, _ in q[1:]] == ["skip", "skip"], "epochs 2 and 3 pass over sample 13"
    assert read_quarantine(tmp_path / "quarantine.json") == [13]
    assert sum(1 for e in result.events if e.name == "anomaly") == 1, "no trip after the quarantine"
    assert finite_params(model)

    again, _ = run(epochs=1)  # a new run in the same directory starts with the quarantine
    kinds = [(e.name, e.action) for e in again.events if e.name in ("quarantine", "anomaly")]
    assert kinds == [("quarantine", "load"), ("quarantine", "skip")]
