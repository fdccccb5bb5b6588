"""A ``torch.compile``d model: findings and snapshots use the names of the user's own module.

``torch.compile(model)`` returns a wrapper whose parameter names and ``state_dict`` keys carry an
``_orig_mod.`` prefix. Checkpoints saved through it do not load into the same model run without
``torch.compile``: pytorch/pytorch#101107, karpathy/nanoGPT#325, huggingface/pytorch-image-models#2003
(``Unexpected key(s) in state_dict: "_orig_mod.stem.conv1.c.weight"`` on resume). The backend is
``eager`` here (dynamo's tracing and the wrapper, without a C++ compiler) to keep the tests fast.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from safetrain import SafeTrainer, load_config
from safetrain.testing import GradFault, PoisonRows
from tests.helpers.engine import BASE, anomalies
from tests.helpers.models import finite_params, loader, mlp, regression_data


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    torch._dynamo.reset()  # no cache or recompile limit carried over from another test
    return torch.compile(model, backend="eager")


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_bad_input_row_is_traced_to_the_layer_by_its_own_name(mode):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    cfg = load_config(None, [*BASE, f"detect.mode={mode}", "sanitize.inputs=off"])
    data = PoisonRows(regression_data(), indices=[100], where="inputs")
    result = SafeTrainer(compiled(model), opt, cfg, loss_fn=F.mse_loss).fit(loader(data), epochs=1)
    event = next(e for e in result.events if e.name == "anomaly")
    assert (event.kind, event.action) == (("forward" if mode == "eager" else "loss"), "skip_batch")
    assert event.detail["diagnosis"]["module"] == "0", event.detail["diagnosis"]
    if mode == "eager":
        assert event.detail["finding"]["module"] == "0", event.detail["finding"]
    assert result.healthy_steps == result.steps - 1 and finite_params(model)


def test_a_non_finite_gradient_names_the_parameter_as_the_model_does():
    model = mlp()
    GradFault(model[2].bias, calls=(5, 6), value=math.inf)  # the step and its replay
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    result = SafeTrainer(compiled(model), opt, load_config(None, BASE), loss_fn=F.mse_loss).fit(
        loader(regression_data()), epochs=1
    )
    assert anomalies(result) == [("gradient", "zero_grads")]
    event = next(e for e in result.events if e.kind == "gradient")
    assert event.detail["diagnosis"]["nonfinite_grads"] == ["2.bias"], event.detail["diagnosis"]


def test_a_snapshot_of_a_compiled_run_resumes_into_the_plain_model_and_back(tmp_path):
    def run(wrap, max_steps=None, resume=None):
        model = mlp(seed=1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = load_config(None, [*BASE, "snapshot.store=safetensors", f"snapshot.dir={tmp_path}", "snapshot.every=5"])
        SafeTrainer(wrap(model), opt, cfg, loss_fn=F.mse_loss).fit(
            loader(regression_data()), epochs=2, max_steps=max_steps, resume=resume
        )
        return model

    full = run(lambda m: m)
    for wrote, resumed_with in ((compiled, lambda m: m), (lambda m: m, compiled)):
        for f in tmp_path.iterdir():
            f.unlink()
        run(wrote, max_steps=12)  # newest snapshot at step 10
        resumed = run(resumed_with, resume=tmp_path)
        for a, b in zip(full.parameters(), resumed.parameters()):
            assert torch.equal(a, b)


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group (DDP wraps a model in it; nothing is sent)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("order", ["ddp_of_compiled", "compiled_ddp", "compile_in_place"])
def test_ddp_and_compile_in_either_order_name_and_snapshot_like_plain_ddp(order, one_rank_group, tmp_path):
    """nanoGPT wraps DDP(torch.compile(m)); PyTorch's docs compile first in place (model.compile());
    both must name parameters and key snapshots like DDP(m): ``module.0.weight``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from safetrain.guard import Guard

    def wrap(model):
        if order == "ddp_of_compiled":
            return DDP(compiled(model))
        if order == "compiled_ddp":
            return compiled(DDP(model))
        model.compile(backend="eager")
        return DDP(model)

    def run(wrapper, model, max_steps, resume=None):
        opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
        cfg = load_config(None, [*BASE, "snapshot.store=safetensors", f"snapshot.dir={tmp_path}", "snapshot.every=5"])
        trainer = SafeTrainer(wrapper, opt, cfg, loss_fn=F.mse_loss)
        trainer.fit(loader(regression_data()), epochs=1, max_steps=max_steps, resume=resume)

    model = mlp(seed=1)
    wrapped = wrap(model)
    with Guard(wrapped, torch.optim.SGD(model.parameters(), lr=0.1), load_config(None, BASE)) as guard:
        assert [n for n, _ in guard._params] == ["module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"]
        assert "_orig_mod" not in " ".join(guard.monitor.names)
    run(wrapped, model, max_steps=7)  # a snapshot at step 5
    plain = mlp(seed=2)
    run(DDP(plain), plain, max_steps=8, resume=tmp_path)  # the snapshot's keys fit DDP(m)


def test_accumulated_micro_batches_share_one_graph_and_a_fault_in_the_third_is_found():
    """Eager mode's hooks are traced into the graph; each micro-batch's forward must start from
    empty record lists, or every micro-batch of a step compiles its own graph."""
    import torch._dynamo.utils as dynamo_utils

    from safetrain.testing import OutputFault

    model = mlp()
    net = compiled(model)
    dynamo_utils.counters.clear()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    cfg = load_config(None, [*BASE, "guard.accumulate_steps=4", "detect.replay.enabled=false"])
    result = SafeTrainer(net, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data()), epochs=1)
    assert result.steps == 4 and result.healthy_steps == 4
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1, dict(dynamo_utils.counters["stats"])

    fault = OutputFault(model[2], calls=[7])  # the third micro-batch of the second step
    result = SafeTrainer(net, opt, cfg, loss_fn=F.mse_loss).fit(loader(regression_data()), epochs=1)
    event = next(e for e in result.events if e.name == "anomaly")
    assert (event.kind, event.detail["finding"]["module"], event.step) == ("forward", "2", 2), event
    assert fault.count >= 7


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="compile stances: torch 2.6 and later")
def test_the_model_runs_compiled_after_a_replay():
    """The replay runs the model under a dispatch mode with every module hooked; traced by dynamo,
    that left the model's code marked as not compilable, and every later step ran eagerly."""
    runs = {"compiled": 0}

    def counting_backend(gm, example_inputs):
        def run(*args):
            runs["compiled"] += 1
            return gm.forward(*args)

        return run

    model = mlp()
    torch._dynamo.reset()
    net = torch.compile(model, backend=counting_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    cfg = load_config(None, [*BASE, "sanitize.inputs=off"])
    data = PoisonRows(regression_data(), indices=[40])  # the third batch
    result = SafeTrainer(net, opt, cfg, loss_fn=F.mse_loss).fit(loader(data, shuffle=False), epochs=1)
    event = next(e for e in result.events if e.name == "anomaly")
    assert event.step == 3 and event.detail["diagnosis"]["module"] == "0", event
    assert runs["compiled"] == result.steps == 16, (runs, result.steps)  # replays eager, training compiled
