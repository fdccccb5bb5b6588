"""Several optimizers in one step: the Muon + AdamW recipe end to end.

The recipe: ``torch.optim.Muon`` for the 2-D hidden weights, AdamW for the embeddings, the head,
the norms and the biases (Keller Jordan, "Muon: An optimizer for hidden layers in neural
networks", kellerjordan.github.io/posts/muon; the modded-nanogpt speedrun; torch.optim.Muon's
own docs: "Muon is intended for 2D parameters ... other parameters such as bias and embedding
should be optimized by a standard method such as AdamW"). Before this change ``SafeTrainer(model,
[muon, adamw])`` crashed: ``AttributeError: 'list' object has no attribute 'param_groups'``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safetrain import Guard, SafeTrainer, load_config
from safetrain.errors import SnapshotError
from safetrain.optimizers import Optimizers, Schedulers
from safetrain.snapshot import TrainState

BAD = 7  # the batch whose forward overflows (a finite input far out of range)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(24, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def _optimizers(model: nn.Module) -> dict:
    hidden = [model[2].weight]  # the 2-D hidden weight: Muon; the rest: AdamW
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return {"muon": torch.optim.Muon(hidden, lr=0.02), "adamw": torch.optim.AdamW(rest, lr=1e-2)}


def _batches(n: int = 12) -> list:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 10, (8 * n, 3), generator=g), torch.randint(0, 4, (8 * n,), generator=g)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 8 * n, 8)]


def _plain(batches: list, record: bool = False) -> tuple:
    """The plain loop with both optimizers; with ``record``, the state after each step."""
    model = _model()
    opts = _optimizers(model)
    states = [_state(model, opts)]
    for x, y in batches:
        for o in opts.values():
            o.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for o in opts.values():
            o.step()
        if record:
            states.append(_state(model, opts))
    return model, opts, states


def _state(model: nn.Module, opts: dict) -> list:
    """Every parameter and every optimizer state tensor (and number), copied."""
    out = [p.detach().clone() for p in model.parameters()]
    for o in opts.values():
        for s in o.state_dict()["state"].values():
            out += [v.clone() if torch.is_tensor(v) else v for _, v in sorted(s.items())]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


def _cfg(tmp_path, *more: str):
    return load_config(None, ["log.progress=false", f"log.dir={tmp_path}", *more])


def test_muon_and_adamw_healthy_fit_is_bitwise_the_plain_loop(tmp_path):
    """Fails before: the list of optimizers had no ``param_groups``."""
    batches = _batches()
    ref_model, ref_opts, _ = _plain(batches)
    model = _model()
    opts = _optimizers(model)
    result = SafeTrainer(model, list(opts.values()), _cfg(tmp_path), loss_fn=F.cross_entropy).fit(batches)
    assert result.healthy_steps == len(batches) and result.optimizer_steps == len(batches)
    assert _same(_state(model, opts), _state(ref_model, ref_opts))


def test_a_fault_restores_both_optimizers_to_the_snapshot(tmp_path):
    """A restore puts the model and BOTH optimizers back to the snapshot's step together."""
    batches = _batches()
    _, _, plain_states = _plain(batches[:BAD], record=True)
    model = _model()
    opts = _optimizers(model)
    model[2].register_forward_hook(lambda m, a, out: out * 1e38 if _Poison.on else out)  # overflows to inf
    cfg = _cfg(tmp_path, "snapshot.every=2", "recovery.actions.forward=restore", "detect.replay.enabled=false")
    with Guard(model, opts, cfg, loss_fn=F.cross_entropy) as guard:
        for i, batch in enumerate(batches[: BAD + 1]):
            _Poison.on = i == BAD
            result = guard.step(batch)
        _Poison.on = False
    assert result.restored, result
    restored = next(e for e in result.events if e.name == "restored")
    step = restored.detail["snapshot_step"]
    assert 0 < step < BAD
    assert _same(_state(model, opts), plain_states[step]), "model and both optimizers are the snapshot's"


class _Poison:
    on = False


def test_safetensors_snapshot_holds_both_and_resumes_bitwise(tmp_path):
    """A disk snapshot holds both optimizers (each under optim/{name}/...); a resume into a fresh
    model and optimizers is bitwise the plain loop's run to the end."""
    batches = _batches(8)
    ref_model, ref_opts, _ = _plain(batches)
    cfg = _cfg(tmp_path, "snapshot.store=safetensors", "snapshot.every=4", "snapshot.keep=4")
    model = _model()
    SafeTrainer(model, _optimizers(model), cfg, loss_fn=F.cross_entropy).fit(batches, max_steps=4)
    snap = tmp_path / "snapshots" / "snapshot-0000000004.safetensors"
    names = _tensor_names(snap)
    assert any(n.startswith("optim/muon/state/0/") for n in names), names
    assert any(n.startswith("optim/adamw/state/") for n in names), names
    model = _model()
    opts = _optimizers(model)
    cfg2 = _cfg(tmp_path / "again", "snapshot.store=safetensors")
    SafeTrainer(model, opts, cfg2, loss_fn=F.cross_entropy).fit(batches, resume=snap)
    assert _same(_state(model, opts), _state(ref_model, ref_opts))


def _tensor_names(path) -> list:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def test_a_snapshot_of_one_optimizer_does_not_load_into_two(tmp_path):
    model = _model()
    one = torch.optim.AdamW(model.parameters(), lr=1e-2)
    captured = TrainState(model, one, rng=False).capture({"step": 0})
    specs = {n: (tuple(t.shape), t.dtype) for n, t in captured.tensors.items()}
    with pytest.raises(SnapshotError, match="one optimizer, the live state optimizers"):
        TrainState(model, Optimizers(_optimizers(model)), rng=False).check_compatible(specs, captured.meta, "f")


def test_lr_backoff_scales_every_group_of_every_optimizer_and_journals_each(tmp_path):
    batches = _batches()
    model = _model()
    opts = _optimizers(model)
    model[2].register_forward_hook(lambda m, a, out: out * 1e38 if _Poison.on else out)
    cfg = _cfg(tmp_path, "snapshot.every=2", "recovery.actions.forward=scale_lr", "detect.replay.enabled=false")
    with Guard(model, opts, cfg, loss_fn=F.cross_entropy) as guard:
        for i, batch in enumerate(batches[: BAD + 1]):
            _Poison.on = i == BAD
            result = guard.step(batch)
        _Poison.on = False
    changed = next(e for e in result.events if e.name == "lr_changed")
    assert changed.detail["optimizers"] == {"muon": [0.01], "adamw": [5e-3]}
    assert opts["muon"].param_groups[0]["lr"] == 0.01 and opts["adamw"].param_groups[0]["lr"] == 5e-3


def test_several_schedulers_step_each_under_the_backoff(tmp_path):
    model = _model()
    opts = _optimizers(model)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in opts.values()]
    trainer = SafeTrainer(model, opts, _cfg(tmp_path), loss_fn=F.cross_entropy, scheduler=scheds)
    trainer.fit(_batches(3))
    assert isinstance(trainer.guard.scheduler, Schedulers)
    assert opts["muon"].param_groups[0]["lr"] == pytest.approx(0.02 / 8)
    assert opts["adamw"].param_groups[0]["lr"] == pytest.approx(1e-2 / 8)


def test_grad_scaler_unscales_every_optimizer(tmp_path):
    """One GradScaler, two optimizers: each is unscaled before the read (a plain fp16 loop calls
    ``scaler.unscale_`` or ``scaler.step`` once per optimizer); the update is bitwise the plain one."""
    batches = _batches(4)
    ref = _model()
    ref_opts = _optimizers(ref)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for x, y in batches:
        for o in ref_opts.values():
            o.zero_grad()
        scaler.scale(F.cross_entropy(ref(x), y)).backward()
        for o in ref_opts.values():
            scaler.step(o)
        scaler.update()
    model = _model()
    opts = _optimizers(model)
    mine = torch.amp.GradScaler("cpu", init_scale=1024.0)
    SafeTrainer(model, opts, _cfg(tmp_path), loss_fn=F.cross_entropy, scaler=mine).fit(batches)
    assert _same(_state(model, opts), _state(ref, ref_opts))
    assert mine.get_scale() == scaler.get_scale()


def test_bad_optimizer_sets_are_refused_with_a_sentence():
    model = _model()
    with pytest.raises(ValueError, match="in both"):
        Optimizers([torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model[4].parameters(), lr=0.1)])
    with pytest.raises(ValueError, match="needs a closure"):
        Optimizers([torch.optim.LBFGS(model[4].parameters()), torch.optim.SGD(model[2].parameters(), lr=0.1)])
    with pytest.raises(TypeError, match="expected a torch optimizer"):
        Optimizers([torch.optim.SGD(model.parameters(), lr=0.1), "adam"])


def test_several_optimizers_under_fsdp2_are_refused_with_a_sentence():
    """Sharded snapshots (torch.distributed.checkpoint) hold one optimizer: several are refused
    when the guard is built, not at the first snapshot."""
    from safetrain.distributed import FSDP2, train_state

    model = _model()
    with pytest.raises(ValueError, match="under FSDP2: sharded snapshots hold one optimizer"):
        train_state(FSDP2, model, Optimizers(_optimizers(model)))
