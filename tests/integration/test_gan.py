"""Alternating objectives: a GAN's discriminator step and generator step under one guard.

The DCGAN loop (pytorch/examples ``dcgan/main.py``: ``netD.zero_grad(); errD.backward();
optimizerD.step()`` then ``netG.zero_grad(); errG.backward(); optimizerG.step()`` per batch),
small: MLP G and D on synthetic 2-D data. One guard over both networks with named steps: a
restore after a fault in either step puts both networks and both optimizers back together, at
the same step. NaN in one step of a GAN's two is a known failure: POSTECH-CVLab/PyTorch-StudioGAN#175
("G/D Losses go NaN in WGAN-GP training"), rosinality/stylegan2-pytorch#210 ("All loss goes to NaN
after around 10 iterations"), eriklindernoren/ML-From-Scratch#29 (a DCGAN's G loss NaN, then D's).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from safetrain import Guard, load_config
from tests.helpers.gan import d_loss, g_loss, gan_and_optimizers

N = 10  # batches


def _data() -> list:
    g = torch.Generator().manual_seed(1)
    return list((torch.randn(64 * N, 2, generator=g) * 0.3 + torch.tensor([1.0, -1.0])).split(64))


def _state(gan: nn.Module, opts: dict) -> list:
    out = [p.detach().clone() for p in gan.parameters()]
    for o in opts.values():
        for s in o.state_dict()["state"].values():
            out += [v.clone() for _, v in sorted(s.items())]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _plain(batches: list, record: bool = False) -> tuple:
    gan, opts = gan_and_optimizers()
    torch.manual_seed(5)
    states = [_state(gan, opts)]
    for real in batches:
        for name, loss_of in (("d", d_loss), ("g", g_loss)):
            gan.zero_grad()
            loss_of(gan, real).backward()
            opts[name].step()
            if record:
                states.append(_state(gan, opts))
    return gan, opts, states


def _cfg(tmp_path, *more: str):
    return load_config(None, ["log.progress=false", f"log.dir={tmp_path}", *more])


def test_healthy_gan_under_one_guard_is_bitwise_the_plain_loop(tmp_path):
    """Fails before: the dict of optimizers had no ``param_groups`` (and ``name=`` did not exist)."""
    batches = _data()
    ref, ref_opts, _ = _plain(batches)
    gan, opts = gan_and_optimizers()
    with Guard(gan, opts, _cfg(tmp_path), step_fn={"d": d_loss, "g": g_loss}) as guard:
        torch.manual_seed(5)
        for real in batches:
            for name in ("d", "g"):
                assert guard.step(real, name=name).trained
    assert guard.counts.healthy_steps == 2 * N
    assert _same(_state(gan, opts), _state(ref, ref_opts))


@pytest.mark.parametrize("faulty", ["d", "g"])
def test_a_fault_in_either_step_restores_both_networks_and_optimizers_together(tmp_path, faulty):
    """A NaN in the discriminator's step or in the generator's: the restore puts G, D, Adam(G)
    and Adam(D) back to one snapshot's step, bitwise the plain loop's state at that step."""
    batches = _data()
    _, _, plain_states = _plain(batches, record=True)
    gan, opts = gan_and_optimizers()
    fault = {"on": False}
    target = gan["d"] if faulty == "d" else gan["g"]
    target[0].register_forward_hook(lambda m, a, out: out * float("nan") if fault["on"] else out)
    cfg = _cfg(tmp_path, "snapshot.every=2", "recovery.actions.forward=restore", "detect.replay.enabled=false")
    with Guard(gan, opts, cfg, step_fn={"d": d_loss, "g": g_loss}) as guard:
        torch.manual_seed(5)
        for i, real in enumerate(batches[:7]):
            for name in ("d", "g"):
                fault["on"] = i == 6 and name == faulty
                result = guard.step(real, name=name)
                if fault["on"]:
                    break
            if fault["on"]:
                break
    assert result.restored and not result.trained
    step = next(e for e in result.events if e.name == "restored").detail["snapshot_step"]
    assert 0 < step < 13
    assert _same(_state(gan, opts), plain_states[step]), "G, D and both optimizers are the snapshot's"


def test_named_steps_are_checked(tmp_path):
    gan, opts = gan_and_optimizers()
    with pytest.raises(ValueError, match="not among the optimizers' names"):
        Guard(gan, opts, _cfg(tmp_path), step_fn={"disc": d_loss, "g": g_loss})
    with Guard(gan, opts, _cfg(tmp_path), step_fn={"d": d_loss, "g": g_loss}) as guard:
        with pytest.raises(ValueError, match="expected name= one of"):
            guard.step(_data()[0])
