"""Contract tests of :mod:`safetrain.adapters`: each private thing of torch, Lightning, accelerate
and transformers that safetrain reads or patches, checked against the installed library, so a
release that changes one fails here (naming what breaks in safetrain) instead of in a run.

Also :class:`FP16Scaler` and :class:`NoScaler` as one interface: the same methods, the no-op one
making no tensor op, the fp16 one read without a host sync.
"""

from __future__ import annotations

import warnings
from typing import List, Tuple

import pytest
import torch

from safetrain.adapters import FP16Scaler, NoScaler, make_scaler, torch_private
from safetrain.testing import count_host_syncs

INIT = 2.0**10
X = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)


def fp16(init_scale: float = INIT) -> Tuple[torch.nn.Linear, torch.optim.SGD, torch.amp.GradScaler, FP16Scaler]:
    """A tiny model and SGD with a real (CPU) GradScaler wrapped for the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return model, opt, scaler, FP16Scaler(scaler, opt)


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return model(X).pow(2).mean()


def plain_grads(model: torch.nn.Module) -> List[torch.Tensor]:
    """The gradients of an unscaled backward (on a copy): what unscaling must give back."""
    twin = torch.nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    loss_of(twin).backward()
    return [p.grad.clone() for p in twin.parameters()]


def backward(model: torch.nn.Module, scaler: FP16Scaler, inf: bool = False) -> None:
    """A scaled backward; ``inf``: one gradient overflows (as a half-precision backward would)."""
    for p in model.parameters():
        p.grad = None
    scaler.scale(loss_of(model)).backward()
    if inf:
        model.weight.grad[0, 0] = float("inf")


# ---------------------------------------------------------------- torch: GradScaler's private state
def test_unscale_runs_once_per_step_however_often_it_is_called():
    """``GradScaler._per_optimizer_states[id(opt)]["stage"]`` (``OptState.UNSCALED``): what
    :meth:`FP16Scaler.unscale_` reads to unscale once. If torch renames it, the guard's unscale
    after a framework's (Lightning's, the Trainer's clip) raises, or unscales twice."""
    model, opt, raw, scaler = fp16()
    backward(model, scaler)
    assert not torch_private.unscaled(raw, opt)
    scaler.unscale_()
    assert torch_private.unscaled(raw, opt), "the stage GradScaler keeps after unscale_ moved"
    scaler.unscale_()  # the second does nothing
    with pytest.raises(RuntimeError, match="unscale_"):
        raw.unscale_(opt)  # what the stage protects against: torch refuses a second unscale
    for p, want in zip(model.parameters(), plain_grads(model)):
        assert torch.equal(p.grad, want), "unscaled once: the plain backward's gradients"


def test_values_are_the_overflow_flag_and_the_scale_as_device_tensors_without_a_host_sync():
    """``found_inf_per_device`` (filled by ``unscale_``) and ``_scale`` (the scale tensor): the
    step's read takes both without ``scaler.step()``'s and ``get_scale()``'s ``.item()``. If either
    goes, an fp16 overflow is judged a gradient anomaly, or a host sync joins every step."""
    model, opt, raw, scaler = fp16()
    assert scaler.loss_scale is None, "GradScaler makes its scale tensor at the first scale()"
    backward(model, scaler)
    assert scaler.values()[0] is None, "no flag before the unscale"
    scaler.unscale_()
    with count_host_syncs() as syncs:
        found_inf, scale = scaler.values()
    assert syncs.count == 0
    assert isinstance(found_inf, torch.Tensor) and float(found_inf) == 0.0
    assert scale is scaler.loss_scale and float(scale) == raw.get_scale() == INIT

    backward(model, scaler, inf=True)
    scaler.reset_for_rerun()
    scaler.unscale_()
    found_inf, scale = scaler.values()
    assert float(found_inf) == 1.0, "an injected inf is the scaler's overflow flag"
    assert scaler.backoff_factor() == raw.get_backoff_factor() == 0.5
    scaler.update()
    assert float(scale) == raw.get_scale() == INIT * 0.5, "the scale tensor changes in place at update()"


def test_a_scaled_loss_divided_by_loss_scale_is_the_loss():
    """``GradScaler._scale`` as Lightning's ``on_before_backward`` uses it: the loss Lightning
    scaled, divided back on the device."""
    model, _, _, scaler = fp16()
    loss = loss_of(model)
    scaled = scaler.scale(loss)
    assert torch.equal(scaled.detach() / scaler.loss_scale, loss.detach())


@pytest.mark.parametrize("first_inf, rerun_inf", [(True, False), (False, True), (False, False)])
def test_reset_for_rerun_unscales_the_rerun_and_the_framework_step_reads_its_flags(first_inf, rerun_inf):
    """``_per_optimizer_states[id(opt)]`` ``"stage"`` set back to ``READY`` and
    ``"found_inf_per_device"`` emptied: a re-run's gradients (scaled like the first run's) are
    unscaled by the next read, and the framework's ``scaler.step(opt)`` skips or applies by the
    re-run's flags. If either key changes, a re-run trains on gradients times the scale, or a
    healthy re-run is skipped for the first run's overflow."""
    model, opt, raw, scaler = fp16()
    backward(model, scaler, inf=first_inf)
    scaler.unscale_()
    assert float(scaler.values()[0]) == float(first_inf)

    scaler.reset_for_rerun()
    backward(model, scaler, inf=rerun_inf)
    scaler.unscale_()  # runs again: the stage was reset
    assert float(scaler.values()[0]) == float(rerun_inf), "the re-run's flags, not the first run's"
    if not rerun_inf:
        for p, want in zip(model.parameters(), plain_grads(model)):
            assert torch.equal(p.grad, want), "the re-run's gradients are unscaled"
    before = [p.detach().clone() for p in model.parameters()]
    raw.step(opt)  # the framework's step: applies unless the re-run overflowed
    raw.update()
    moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert moved is not rerun_inf
    assert raw.get_scale() == (INIT * 0.5 if rerun_inf else INIT)


def test_reset_for_rerun_right_after_update_changes_nothing():
    model, opt, raw, scaler = fp16()
    backward(model, scaler)
    scaler.unscale_()
    scaler.update()
    scaler.reset_for_rerun()
    backward(model, scaler)
    scaler.unscale_()
    assert float(scaler.values()[0]) == 0.0 and raw.get_scale() == INIT


def test_at_backward_end_runs_once_the_whole_backward_is_done():
    """``torch.autograd.Variable._execution_engine.queue_callback``: the Hugging Face callback
    decides a step there (before the Trainer clips). If it goes, the decision comes after the
    Trainer's clip has made every gradient NaN."""
    seen = []
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()

    def at_end() -> None:
        seen.append((w.grad is not None, torch.is_grad_enabled()))

    loss.register_hook(lambda grad: torch_private.at_backward_end(at_end))
    loss.backward()
    assert seen == [(True, False)], "once, after the leaves' gradients, with grad mode off"
    with pytest.raises(RuntimeError):
        torch_private.at_backward_end(at_end)  # outside a backward


def test_after_backward_end_runs_after_callbacks_queued_later_in_the_backward():
    """A final callback queued from a final callback runs after every one queued before it: the
    Hugging Face callback decides after DDP's reducer (which queues its finalize at the last
    bucket, late in the backward) has written the all-reduced gradients. If it goes, the decision
    reads each rank's own gradients, before the all-reduce."""
    order = []
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    loss.register_hook(lambda grad: torch_private.after_backward_end(lambda: order.append("guard")))
    w.register_hook(lambda grad: torch_private.at_backward_end(lambda: order.append("late")))  # as DDP's
    loss.backward()
    assert order == ["late", "guard"]


def test_profiler_enabled_says_whether_a_profiler_records():
    """``torch.autograd._profiler_enabled``: the guard frees gradients without ``zero_grad``'s
    profiler range unless one records. If it goes, every step opens the range (a little slower)."""
    assert hasattr(torch.autograd, "_profiler_enabled"), "gone: profiler_enabled() now always says True"
    assert torch_private.profiler_enabled() is False
    with torch.autograd.profiler.profile():
        assert torch_private.profiler_enabled() is True


# ---------------------------------------------------------------- the scaler as one interface
def _public(obj: object) -> set:
    return {n for n in dir(obj) if not n.startswith("_")}


def test_no_scaler_has_the_fp16_scalers_methods():
    _, opt, _, scaler = fp16()
    assert _public(NoScaler()) == _public(scaler) - {"optimizer"}


def test_no_scaler_does_nothing_at_no_cost():
    """The healthy path calls every method each step: no tensor op, no allocation."""
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    scaler, loss = NoScaler(), torch.tensor(2.0)
    with Count():
        assert scaler.scale(loss) is loss
        scaler.unscale_()
        assert scaler.values() == (None, None) and scaler.loss_scale is None and scaler.scaler is None
        assert scaler.backoff_factor() == 1.0 and scaler.enabled is False
        scaler.update()
        scaler.reset_for_rerun()
        assert scaler.state_dict() == {}
        scaler.load_state_dict({})
    assert calls == []


def test_no_scaler_refuses_a_grad_scalers_state():
    with pytest.raises(ValueError, match="GradScaler's state"):
        NoScaler().load_state_dict(torch.amp.GradScaler("cpu").state_dict())


def test_fp16_scaler_state_round_trips_through_the_grad_scaler():
    model, _, raw, scaler = fp16()
    backward(model, scaler, inf=True)
    scaler.unscale_()
    scaler.update()
    _, opt, other, twin = fp16()
    twin.load_state_dict(scaler.state_dict())
    assert other.get_scale() == raw.get_scale() == INIT * 0.5 and twin.scaler is other


def test_fp16_scaler_refuses_what_is_not_an_enabled_grad_scaler():
    opt = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="expected a torch.amp.GradScaler, got dict"):
        FP16Scaler({}, opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="disabled"):
        FP16Scaler(torch.amp.GradScaler("cpu", enabled=False), opt)


USER = torch.amp.GradScaler("cpu", init_scale=8.0)
OFF = torch.amp.GradScaler("cpu", enabled=False)


@pytest.mark.parametrize(
    "given, dtype, want",
    [
        (None, None, "none"),  # full precision
        (None, "bfloat16", "none"),  # bf16 needs no scaler
        (None, torch.bfloat16, "none"),
        (None, "float16", "new"),  # made from amp.init_scale
        (None, torch.float16, "new"),
        (USER, None, "user"),  # the user's enabled scaler, whatever the autocast dtype
        (USER, "float16", "user"),
        (OFF, "float16", "none"),  # a disabled one: scaling turned off, none made in its place
        (OFF, None, "none"),
    ],
)
def test_make_scaler_mirrors_the_guards_choice(given, dtype, want):
    opt = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    got = make_scaler(given, opt, dtype, torch.device("cpu"), init_scale=64.0)
    msg = f"make_scaler({given}, {dtype}) -> {got}"
    if want == "none":
        assert isinstance(got, NoScaler), msg
    else:
        assert isinstance(got, FP16Scaler) and got.optimizer is opt, msg
        assert got.scaler is USER if want == "user" else got.scaler.get_scale() == 64.0, msg


def test_make_scaler_names_a_bad_argument():
    opt = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="amp_dtype: expected None, float16 or bfloat16, got 'fp8'"):
        make_scaler(None, opt, "fp8", "cpu")
    with pytest.raises(TypeError, match="GradScaler or None, got str"):
        make_scaler("yes", opt, None, "cpu")  # type: ignore[arg-type]


# ---------------------------------------------------------------- Lightning
QUIET_LIGHTNING = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def _lightning_module_with_a_trainer():
    """A LightningModule attached to a Trainer outside its loop: ``self.log`` raises there
    (Lightning's result collection is not set up), as it would inside the guard's own forwards."""
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self.layer(batch).pow(2).mean()
            self.log("loss", loss)
            self.log_dict({"twice": loss * 2})
            return loss

    module = Module()
    module.trainer = pl.Trainer(accelerator="cpu", **QUIET_LIGHTNING)
    return module


def test_silenced_logging_makes_log_a_no_op_and_puts_the_methods_back():
    """``LightningModule.log``/``log_dict`` shadowed on the instance: the guard's re-runs of
    ``training_step`` log nothing. If Lightning stops looking ``log`` up on the instance, a
    replay's values land in the run's metrics or raise inside the guard."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch import LightningModule

    from safetrain.adapters.lightning_private import silenced_logging

    module = _lightning_module_with_a_trainer()
    with pytest.raises(MisconfigurationException):
        module.training_step(X, 0)  # the real log, outside Lightning's loop
    with silenced_logging(module):
        module.training_step(X, 0)
        with silenced_logging(module):  # nested: the outer silence holds after the inner
            pass
        module.training_step(X, 0)
    assert "log" not in vars(module) and "log_dict" not in vars(module)
    assert module.log.__func__ is LightningModule.log and module.log_dict.__func__ is LightningModule.log_dict
    with pytest.raises(ValueError), silenced_logging(module):
        raise ValueError("a re-run failed")
    assert "log" not in vars(module), "put back on an exception too"
    with pytest.raises(MisconfigurationException):
        module.training_step(X, 0)


def test_precision_plugin_gives_its_scaler_and_forward_context():
    """``trainer.precision_plugin.scaler`` and ``.forward_context()``: the guard shares Lightning's
    fp16 GradScaler and runs its re-runs under Lightning's autocast. If they go, fp16 overflows
    are judged gradient anomalies and re-runs run in full precision."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins import MixedPrecision

    from safetrain.adapters.lightning_private import forward_context, precision_scaler

    quiet = QUIET_LIGHTNING
    scaler = torch.amp.GradScaler("cpu")
    fp16 = pl.Trainer(accelerator="cpu", plugins=[MixedPrecision("16-mixed", "cpu", scaler)], **quiet)
    assert precision_scaler(fp16) is scaler
    with forward_context(fp16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.float16
    full = pl.Trainer(accelerator="cpu", **quiet)
    assert precision_scaler(full) is None
    with forward_context(full):
        assert not torch.is_autocast_enabled("cpu")


# ---------------------------------------------------------------- accelerate and transformers
@pytest.fixture
def fresh_accelerate():
    """accelerate's process-wide state is reset before the test (an earlier Trainer's would refuse
    this test's fp16) and after it (a later Trainer with another precision would be refused)."""
    state = pytest.importorskip("accelerate.state")
    state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    state.AcceleratorState._reset_state(reset_partial_state=True)


def _accelerated(scaler: torch.amp.GradScaler):
    """accelerate's Accelerator and its wrapped optimizer, with an fp16 GradScaler given to it as
    on a GPU (accelerate makes none on the CPU)."""
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.scaler, accelerator.native_amp = scaler, True
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, wrapped = accelerator.prepare(model, opt)
    return accelerator, model, opt, wrapped


def test_accelerate_optimizer_unwraps_to_the_torch_optimizer_with_its_scaler_and_gradient_state(fresh_accelerate):
    """``AcceleratedOptimizer.optimizer``, ``.scaler`` and ``.gradient_state``: the GradScaler keys
    its state by the inner optimizer, and ``sync_gradients`` marks a step's last micro-batch. If
    they go, the guard reads no overflow flag, makes no scaler, or decides at every micro-batch."""
    from safetrain.adapters.huggingface_private import gradient_state, optimizer_scaler, unwrap_optimizer

    scaler = torch.amp.GradScaler("cpu")
    _, _, opt, wrapped = _accelerated(scaler)
    assert wrapped is not opt and unwrap_optimizer(wrapped) is opt and unwrap_optimizer(opt) is opt
    assert optimizer_scaler(wrapped) is scaler and optimizer_scaler(opt) is None
    assert gradient_state(wrapped).sync_gradients is True and gradient_state(opt) is None


def test_unscale_once_lets_the_guard_and_accelerates_clip_both_unscale(fresh_accelerate):
    """accelerate's ``clip_grad_norm_`` calls ``scaler.unscale_(optimizer)``; after the guard's
    unscale GradScaler refuses it, unless :func:`unscale_once` replaced ``unscale_`` on the
    instance. The undo puts the class's method back."""
    from safetrain.adapters.huggingface_private import unscale_once

    scaler = torch.amp.GradScaler("cpu", init_scale=INIT)
    accelerator, model, opt, wrapped = _accelerated(scaler)
    guard = FP16Scaler(scaler, opt)
    backward(model, guard)
    guard.unscale_()
    unscaled = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="unscale_"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # what the Trainer's clip does, unpatched
    undo = unscale_once(scaler)
    accelerator.clip_grad_norm_(model.parameters(), 1e9)  # now a no-op unscale (and a clip by 1.0)
    for p, want in zip(model.parameters(), unscaled):
        assert torch.equal(p.grad, want), "unscaled once, by the guard"
    other = torch.amp.GradScaler("cpu")
    assert "unscale_" not in vars(other), "the class is untouched"
    undo()
    assert "unscale_" not in vars(scaler) and scaler.unscale_.__func__ is torch.amp.GradScaler.unscale_
    undo()  # twice: nothing


class _Positional(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor = None) -> torch.Tensor:
        return self.layer(x)


class _Kwargs(_Positional):
    def forward(self, x: torch.Tensor, labels: torch.Tensor = None, **kwargs) -> torch.Tensor:  # type: ignore[override]
        return self.layer(x)


class _Refuses(_Kwargs):
    accepts_loss_kwargs = False


class _Accepts(_Positional):
    accepts_loss_kwargs = True


@pytest.mark.parametrize("model_type", [_Positional, _Kwargs, _Refuses, _Accepts])
def test_takes_loss_kwargs_is_the_trainers_own_rule(model_type, tmp_path):
    """``Trainer.model_accepts_loss_kwargs`` (decided in ``Trainer.__init__``): whether the Trainer
    divides a micro-batch's loss by the accumulation. If the rule changes, the guard's re-runs
    and replays divide the loss differently from the Trainer."""
    transformers = pytest.importorskip("transformers")
    from safetrain.adapters.huggingface_private import takes_loss_kwargs

    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    model = model_type()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = transformers.Trainer(model=model, args=args)
    assert takes_loss_kwargs(model) is trainer.model_accepts_loss_kwargs, model_type.__name__


def test_ddp_wrapper_of_finds_the_trainers_wrapper_around_the_model_it_hands_callbacks(tmp_path):
    """transformers hands callbacks ``Trainer.model`` (inside accelerate's DDP), not
    ``model_wrapped``: the wrapper is found among the model's referrers. If this breaks, the
    callback refuses to start under DDP (naming it) instead of guarding each rank on its own."""
    import gc

    import torch.distributed as dist

    from safetrain.adapters.huggingface_private import ddp_wrapper_of

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        inner = torch.nn.Linear(4, 2)
        assert ddp_wrapper_of(inner) is None
        wrapper = torch.nn.parallel.DistributedDataParallel(inner)
        assert ddp_wrapper_of(inner) is wrapper and ddp_wrapper_of(wrapper) is wrapper
        other = torch.nn.parallel.DistributedDataParallel(inner)  # an earlier Trainer's, still alive
        with pytest.raises(RuntimeError, match="found 2 DistributedDataParallel wrappers"):
            ddp_wrapper_of(inner)
        del other, wrapper
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_log_before_reporters_moves_the_callback_ahead_of_report_to_integrations():
    """``CallbackHandler.callbacks``: the Trainer puts ``report_to`` integrations before the user's
    callbacks; the callback moves itself ahead of them so the values it adds reach them."""
    pytest.importorskip("transformers")
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerCallback

    from safetrain.adapters.huggingface_private import log_before_reporters

    class Reporter(TrainerCallback):
        __module__ = "transformers.integrations.integration_utils"

    mine, reporter, other = TrainerCallback(), Reporter(), TrainerCallback()
    handler = CallbackHandler([DefaultFlowCallback, reporter, other, mine], None, None, None, None)
    assert log_before_reporters(mine)
    assert handler.callbacks[1:] == [mine, reporter, other]
    assert not log_before_reporters(TrainerCallback()), "not in any Trainer's list"
