"""Overhead of the guarded step on attention models (issue 28): a tiny Hugging Face GPT-2 and a
BERT-style encoder (both built from configs, random weights, dict batches, the model's own loss)
and the ``nn.TransformerEncoder`` model of ``overhead.py``, against a plain loop.

Variants (each ``Guard.step`` with the default configuration but for the key named):
``plain`` (zero_grad, forward, the model's loss, backward, SGD step), ``lazy``
(``detect.mode=lazy``), ``module`` (eager, ``detect.granularity=module``: a hook on every module
but the pass-through ones, the behaviour before issue 28) and ``block`` (eager,
``detect.granularity=block``: one hook per repeated block, the default). Every variant trains the
same model and optimizer in turn; a round runs ``--steps`` steps of each variant back to back,
the variants' order rotated every round, hooks put on and taken off around each block of steps,
outside the timing. A round's ratio is the variant's time over the plain loop's in that round, by
wall clock and by the process's CPU time (steadier on a shared machine); the table gives the
median over the rounds and their min-max.

Run: ``.venv/bin/python benchmarks/attention_overhead.py --rounds 41 --steps 1``; with ``--profile``, where the
eager cost goes (hooked calls per step, the hooks' CPU time, the fold into the read).
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch: idle OpenMP threads must not spin for ms

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Tuple  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overhead import Encoder  # noqa: E402

import safetrain  # noqa: E402


def tokens(batch: int, length: int, vocab: int, masked_lm: bool) -> Dict[str, torch.Tensor]:
    """A dict batch: ids, an attention mask with right padding, labels (-100 on padding; for a
    masked LM also on 85% of the other positions)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    lens = torch.randint(length // 2, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lens[:, None]).long()
    labels = torch.where(mask.bool(), ids, -100)
    if masked_lm:
        labels = torch.where(torch.rand(batch, length, generator=g) < 0.15, labels, -100)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


def gpt2() -> Tuple[nn.Module, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=1000, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg), tokens(64, 32, 1000, masked_lm=False)


def bert() -> Tuple[nn.Module, Any]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=32,
    )
    return BertForMaskedLM(cfg), tokens(64, 32, 1000, masked_lm=True)


def encoder() -> Tuple[nn.Module, Any]:
    return Encoder(), (torch.randn(2, 128, 256), torch.randint(0, 10, (2,)))


MODELS: Dict[str, Callable[[], Tuple[nn.Module, Any]]] = {"gpt2": gpt2, "bert": bert, "transformer": encoder}


class Variant:
    """One way to run a step on the shared model; ``start``/``stop`` around each timed block."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, batch: Any, overrides: List[str]) -> None:
        self.model, self.opt, self.batch = model, opt, batch
        self.guard = None
        if overrides is not None:
            cfg = safetrain.load_config(None, ["log.progress=false", "log.level=WARNING", *overrides])
            loss_fn = nn.CrossEntropyLoss() if isinstance(batch, tuple) else None
            self.guard = safetrain.Guard(model, opt, cfg, loss_fn=loss_fn)
            self.guard.monitor.detach()  # hooks only around this variant's own steps

    def start(self) -> None:
        self.opt.zero_grad(set_to_none=True)  # the previous variant's gradients, outside the timing
        if self.guard is not None:
            self.guard.monitor.attach()

    def stop(self) -> None:
        if self.guard is not None:
            self.guard.monitor.detach()

    def step(self) -> None:
        if self.guard is not None:
            result = self.guard.step(self.batch)
            if result is None or result.action:
                raise RuntimeError(f"benchmark step was not healthy: {result}")
            return
        self.opt.zero_grad(set_to_none=True)
        if isinstance(self.batch, tuple):
            loss = nn.functional.cross_entropy(self.model(self.batch[0]), self.batch[1])
        else:
            loss = self.model(**self.batch).loss
        loss.backward()
        self.opt.step()


VARIANTS: Dict[str, Any] = {
    "plain": None,
    "lazy": ["detect.mode=lazy"],
    "module": ["detect.granularity=module"],
    "block": ["detect.granularity=block"],
}


def measure(name: str, variants: List[str], rounds: int, steps: int) -> Dict[str, Dict[str, List[float]]]:
    """Per-round wall and CPU ratios of every variant to ``plain`` on model ``name``."""
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    built = {v: Variant(model, opt, batch, VARIANTS[v]) for v in variants}
    for v in variants:  # warm-up: first calls, the guard's first snapshot
        built[v].start()
        for _ in range(3):
            built[v].step()
        built[v].stop()
    wall: Dict[str, List[float]] = {v: [] for v in variants}
    cpu: Dict[str, List[float]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            built[v].start()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                built[v].step()
            wall[v].append(time.perf_counter() - t0)
            cpu[v].append(time.process_time() - c0)
            built[v].stop()
    out = {}
    for v in variants:
        out[v] = {
            "ms": [t / steps * 1e3 for t in wall[v]],
            "wall": [a / b for a, b in zip(wall[v], wall["plain"])],
            "cpu": [a / b for a, b in zip(cpu[v], cpu["plain"])],
        }
    return out


def profile(name: str, rounds: int) -> None:
    """Where the eager cost goes on model ``name``: hooks and hooked calls per step, the hooks'
    own CPU time (a timer around each hook the monitor makes) and the fold of their values into
    the step's one read (``stack`` + ``tolist``), per granularity, against a plain step's CPU time."""
    import safetrain.detect.activations as activations

    spent: Dict[str, List[int]] = {}
    current = [""]
    make_hook = activations.make_hook

    def timed(*args: Any, **kwargs: Any) -> Any:
        hook = make_hook(*args, **kwargs)

        def run(module: nn.Module, inputs: Any, out: Any) -> None:
            t = time.thread_time_ns()
            hook(module, inputs, out)
            spent[current[0]].append(time.thread_time_ns() - t)

        return run

    torch.manual_seed(0)
    model, batch = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    monitors = {
        g: activations.ActivationMonitor(model, skip_passthrough=True, granularity=g) for g in ("module", "block")
    }
    monitors["plain"] = activations.ActivationMonitor(model, enabled=False)
    cpu: Dict[str, List[int]] = {g: [] for g in monitors}
    fold: Dict[str, List[int]] = {g: [] for g in monitors}
    activations.make_hook = timed
    try:
        for r in range(rounds + 1):
            for g, monitor in monitors.items():
                current[0] = g
                spent.setdefault(g, [])
                with monitor.attach():
                    opt.zero_grad(set_to_none=True)
                    monitor.reset()
                    t0 = time.thread_time_ns()
                    if isinstance(batch, tuple):
                        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
                    else:
                        loss = model(**batch).loss
                    loss.backward()
                    t1 = time.thread_time_ns()
                    torch.stack([loss.detach(), *monitor.records]).tolist()  # host sync: the step's read
                    t2 = time.thread_time_ns()
                    opt.step()
                    if r:  # round 0 is the warm-up
                        cpu[g].append(t1 - t0)
                        fold[g].append(t2 - t1)
                    else:
                        spent[g].clear()
    finally:
        activations.make_hook = make_hook
    plain = statistics.median(cpu["plain"]) / 1e3
    print(f"{name}: plain forward+backward {plain / 1e3:.2f} ms CPU (median of {rounds})")
    for g in ("module", "block"):
        calls = len(spent[g]) / rounds
        hooks_us = sum(spent[g]) / rounds / 1e3
        fold_us = statistics.median(fold[g]) / 1e3 - statistics.median(fold["plain"]) / 1e3
        print(
            f"  {g:6s}: {len(monitors[g].names)} hooks, {calls:.0f} hooked calls a step, "
            f"hooks {hooks_us:.0f} us a step "
            f"({hooks_us / calls:.1f} us a call), fold into the read +{fold_us:.0f} us; "
            f"{(hooks_us + fold_us) / plain * 100:.2f}% of the plain forward+backward"
        )


def _cell(xs: List[float]) -> str:
    return f"{statistics.median(xs):.3f}x ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: Any = None) -> int:
    """Run the comparison and print one markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--steps", type=int, default=1, help="steps of each variant per round")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the least noise on a shared machine)")
    p.add_argument("--profile", action="store_true", help="print where the eager cost goes instead of the table")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if a.profile:
        for name in a.models.split(","):
            profile(name, a.rounds)
        return 0
    variants = ["plain"] + [v for v in a.variants.split(",") if v and v != "plain"]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {a.rounds} rounds x {a.steps} steps, "
        f"load average {os.getloadavg()[0]:.2f} at start"
    )
    print("| model | variant | median step (ms) | wall ratio (min-max) | CPU-time ratio (min-max) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name in a.models.split(","):
        res = measure(name, variants, a.rounds, a.steps)
        for v in variants:
            r = res[v]
            print(f"| {name} | {v} | {statistics.median(r['ms']):.2f} | {_cell(r['wall'])} | {_cell(r['cpu'])} |")
        sys.stdout.flush()
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
