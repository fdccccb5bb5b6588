"""Overhead of safetrain's detectors against a plain training loop, measured side by side.

For each model (an 8-layer MLP, a 4-layer transformer encoder, a 4-conv CNN with BatchNorm, a
tiny 3-layer MLP) every variant trains the SAME model and optimizer in turn, interleaved step by
step: each round runs one step of every variant, the order rotated each round, hooks put on and
taken off around each step outside the timing. A variant's ratio in a round is its step time
over the plain step's; the table gives the median over all rounds, the min-max of the medians of
10 consecutive slices of the rounds, and, as a cross-check, the ratio of total process CPU time.

Variants: ``plain`` (zero_grad, forward, loss, backward, SGD step), ``plain_item`` (the same
reading ``loss.item()`` every step, one host sync like the guard's), ``eager`` and ``lazy``
(safetrain's detectors composed as the guard composes them, one host read per step),
``eager_skip`` (eager without hooks on pass-through modules such as ReLU and dropout),
``isnan_hooks`` (per-layer ``isnan().any()``/``isinf().any()`` hooks and a per-parameter norm
loop, the usual hand-written check) and ``anomaly`` (``torch.autograd.detect_anomaly``).
Add one with :func:`register_variant` (the guard and trainer will)::

    @register_variant("guard")
    def guard_variant(s: Setup) -> Variant: ...

Run: ``.venv/bin/python benchmarks/overhead.py`` (``--help`` for rounds, models, variants).
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch: idle OpenMP threads must not spin for ms

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from safetrain.detect import ActivationMonitor, GradCheck, StepFlags, WeightCheck, scan_batch  # noqa: E402

warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")


# ----------------------------------------------------------------------------- models


def mlp(width: int, depth: int, classes: int = 10) -> nn.Module:
    """``depth`` Linear layers of ``width`` with ReLU between, the last one to ``classes``."""
    layers: List[nn.Module] = []
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def cnn(channels: int = 64, convs: int = 4, classes: int = 10) -> nn.Module:
    """``convs`` 3x3 conv + BatchNorm + ReLU blocks, global average pool, linear head."""
    layers: List[nn.Module] = []
    c = 3
    for _ in range(convs):
        layers += [nn.Conv2d(c, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        c = channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` with a mean-pooled linear head."""

    def __init__(self, d_model: int = 256, heads: int = 4, ff: int = 512, layers: int = 4, classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def make_models() -> Dict[str, Callable[[], tuple]]:
    """Model name -> factory of ``(model, inputs, targets)``."""
    return {
        "mlp": lambda: (mlp(512, 8), torch.randn(256, 512), torch.randint(0, 10, (256,))),
        "transformer": lambda: (Encoder(), torch.randn(2, 128, 256), torch.randint(0, 10, (2,))),
        "cnn": lambda: (cnn(), torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))),
        "tiny": lambda: (mlp(64, 3), torch.randn(32, 64), torch.randint(0, 10, (32,))),
        # Sizes for a GPU (named with --models; not in the default list): launch-bound no more.
        "mlp_wide": lambda: (mlp(4096, 8), torch.randn(1024, 4096), torch.randint(0, 10, (1024,))),
        "transformer_big": lambda: (Encoder(1024, 16, 4096, 4), torch.randn(8, 512, 1024), torch.randint(0, 10, (8,))),
    }


#: The models run when --models is not given (the detection issue's four).
DEFAULT_MODELS = ("mlp", "transformer", "cnn", "tiny")


# ----------------------------------------------------------------------------- variants


@dataclass
class Setup:
    """What every variant trains: one model, one optimizer, one fixed batch."""

    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    optimizer: torch.optim.Optimizer
    loss_fn: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    steps: int = 0
    amp: Optional[torch.dtype] = None  # autocast dtype of the forward (None: full precision)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast context (a no-op without ``amp``)."""
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.inputs.device.type, dtype=self.amp)


def _nothing() -> None:
    return None


@dataclass
class Variant:
    """A way to run one training step. ``start``/``stop`` put on and take off what the variant
    adds to the shared model (hooks) around each timed step, outside the timing."""

    step: Callable[[], None]
    start: Callable[[], None] = _nothing
    stop: Callable[[], None] = _nothing


VARIANTS: Dict[str, Callable[[Setup], Variant]] = {}


def register_variant(name: str) -> Callable[[Callable[[Setup], Variant]], Callable[[Setup], Variant]]:
    """Add a variant to the comparison: ``@register_variant("guard") def f(setup) -> Variant``."""

    def deco(factory: Callable[[Setup], Variant]) -> Callable[[Setup], Variant]:
        VARIANTS[name] = factory
        return factory

    return deco


def _plain(s: Setup, read_loss: bool) -> Variant:
    model, x, y, opt, loss_fn = s.model, s.inputs, s.targets, s.optimizer, s.loss_fn

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with s.autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if read_loss:
            loss.item()

    return Variant(step)


@register_variant("plain")
def plain(s: Setup) -> Variant:
    return _plain(s, read_loss=False)


@register_variant("plain_item")
def plain_item(s: Setup) -> Variant:
    """The plain loop reading its loss every step (``loss.item()`` for a log line or a progress
    bar, as most loops do): one host sync per step, like the guard's, and nothing else."""
    return _plain(s, read_loss=True)


def _safetrain(s: Setup, eager: bool, skip_passthrough: bool = False) -> Variant:
    """The detectors as the guard composes them: scan, hooks, fused grad check, one read."""
    model, x, y, opt, loss_fn = s.model, s.inputs, s.targets, s.optimizer, s.loss_fn
    monitor = ActivationMonitor(model, enabled=eager, skip_passthrough=skip_passthrough)
    grads = GradCheck(model)
    weights = WeightCheck(model, every=100)
    flags = StepFlags()
    clean = any(True for _ in model.buffers())  # only state updated in forward needs a clean batch

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        monitor.reset()
        sx = scan_batch(x, clean=clean)
        sy = scan_batch(y, batch_size=sx.batch_size, clean=clean)
        with s.autocast():
            loss = loss_fn(model(sx.batch), sy.batch)
        loss.backward()
        g = grads.run()
        s.steps += 1
        flags.put("input", sx.values)
        flags.put("target", sy.values)
        flags.put("loss", loss)
        flags.put("grad_norms", g.norm_list)
        flags.put("weights", weights.maybe_run(s.steps))
        flags.put("forward", monitor.records)
        read = flags.read()  # host sync: the step's one read
        if not read.healthy:
            raise RuntimeError(f"benchmark step tripped: {read.tripped()}")
        opt.step()

    return Variant(step, monitor.attach, monitor.detach)


@register_variant("eager")
def eager(s: Setup) -> Variant:
    return _safetrain(s, eager=True)


@register_variant("eager_skip")
def eager_skip(s: Setup) -> Variant:
    """Eager with ``skip_passthrough=True``: no hooks on ReLU, dropout, pooling, flatten."""
    return _safetrain(s, eager=True, skip_passthrough=True)


@register_variant("lazy")
def lazy(s: Setup) -> Variant:
    return _safetrain(s, eager=False)


@register_variant("isnan_hooks")
def isnan_hooks(s: Setup) -> Variant:
    """The usual hand-written check: sync per layer and per parameter."""
    model, x, y, opt, loss_fn = s.model, s.inputs, s.targets, s.optimizer, s.loss_fn

    def hook(module: nn.Module, args: tuple, out: object) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                if torch.isnan(o).any() or torch.isinf(o).any():
                    raise RuntimeError("non-finite activation")

    handles: List[torch.utils.hooks.RemovableHandle] = []
    named = list(model.named_parameters())

    def start() -> None:
        handles.extend(m.register_forward_hook(hook) for m in model.modules())

    def stop() -> None:
        while handles:
            handles.pop().remove()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with s.autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
        for _, p in named:
            if p.grad is not None and not torch.isfinite(p.grad.norm()):
                raise RuntimeError("non-finite gradient")
        opt.step()

    return Variant(step, start, stop)


@register_variant("anomaly")
def anomaly(s: Setup) -> Variant:
    model, x, y, opt, loss_fn = s.model, s.inputs, s.targets, s.optimizer, s.loss_fn

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autograd.detect_anomaly():
            with s.autocast():
                loss = loss_fn(model(x), y)
            loss.backward()
        opt.step()

    return Variant(step)


# ----------------------------------------------------------------------------- runner


def measure(
    factory: Callable[[], tuple],
    variants: List[str],
    seconds: float,
    groups: int = 10,
    device: str = "cpu",
    amp: Optional[torch.dtype] = None,
    block: int = 1,
) -> Dict[str, dict]:
    """Time every variant on one model, ``block`` steps each per round, order rotated every round.

    Each round runs one step of every variant back to back (hooks put on and taken off around
    each step, outside the timing), so a variant and the plain loop are compared within a fraction
    of a second: what other processes do to the machine hits both alike. Rounds go on for
    ``seconds`` (at least ``3 * groups`` rounds). A variant's ratio in a round is its step time
    over the plain step's; the result is the median over all rounds, and the min-max of the
    medians of ``groups`` consecutive slices of the rounds.

    On a GPU a variant's time is that of ``block`` steps queued back to back, from an idle device
    to an idle device, divided by ``block``: a plain loop runs ahead of its kernels, a guarded one
    waits once per step for its read, and that difference is part of what is measured.
    """
    torch.manual_seed(0)
    model, x, y = factory()
    model, x, y = model.to(device), x.to(device), y.to(device)
    setup = Setup(model, x, y, torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9), amp=amp)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else _nothing
    built = {v: VARIANTS[v](setup) for v in variants}
    for v in variants:  # warm-up: first-call costs, the monitor's execution order
        built[v].start()
        for _ in range(3):
            built[v].step()
        built[v].stop()
    times: Dict[str, List[float]] = {v: [] for v in variants}
    cpu: Dict[str, List[float]] = {v: [] for v in variants}
    deadline, r = time.perf_counter() + seconds, 0
    while r < 3 * groups or time.perf_counter() < deadline:
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            variant = built[v]
            variant.start()
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(block):
                variant.step()
            sync()
            t1, c1 = time.perf_counter(), time.process_time()
            variant.stop()
            times[v].append((t1 - t0) / block)
            cpu[v].append((c1 - c0) / block)
        r += 1
    plain, plain_cpu = times["plain"], cpu["plain"]
    out = {}
    for v in variants:
        ratios = [a / b for a, b in zip(times[v], plain)]
        size = len(ratios) // groups
        slices = [statistics.median(ratios[i * size : (i + 1) * size]) for i in range(groups)]
        out[v] = {
            "ms": statistics.median(times[v]) * 1e3,
            "ratio": statistics.median(ratios),
            "min": min(slices),
            "max": max(slices),
            "cpu": sum(cpu[v]) / sum(plain_cpu),
            "rounds": r,
        }
    return out


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else device


def main(argv: Optional[List[str]] = None) -> int:
    """Run the comparison and print one markdown table per model."""
    models = make_models()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="time spent on each model (default 30)")
    parser.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help="comma-separated subset of " + ",".join(models)
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    parser.add_argument("--device", default="cpu", help="where the model and batch live (default cpu; e.g. cuda)")
    # (no float16: a plain loop would need its own GradScaler to be compared with the guard's)
    parser.add_argument("--amp", choices=["bfloat16"], help="autocast every variant's forward")
    parser.add_argument("--block", type=int, help="steps per variant per round (default 1 on the CPU, 10 on a GPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    block = args.block or (1 if torch.device(args.device).type == "cpu" else 10)
    variants = [v for v in args.variants.split(",") if v]
    if "plain" not in variants:
        variants.insert(0, "plain")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.seconds:g} s per model, "
        f"device {_device_name(args.device)}, amp {args.amp}, {block} step(s) per variant per round, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    print("| model | variant | median step (ms) | ratio to plain | min-max of 10 slices | CPU-time ratio | rounds |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for name in args.models.split(","):
        amp = getattr(torch, args.amp) if args.amp else None
        res = measure(models[name], variants, args.seconds, device=args.device, amp=amp, block=block)
        for v in variants:
            r = res[v]
            print(
                f"| {name} | {v} | {r['ms']:.2f} | {r['ratio']:.3f}x | {r['min']:.2f}-{r['max']:.2f} "
                f"| {r['cpu']:.3f}x | {r['rounds']} |",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
