"""Overhead of ``SafeTrainingCallback`` in a real ``transformers.Trainer`` against the same Trainer
without it, on the same model and data (GPT-2 built from a config, random weights, CPU).

Each round trains both variants for ``--steps`` optimizer steps (one ``trainer.train()`` each,
a fresh model copied from one initial state, the order rotated from round to round); a callback
times every step from ``on_step_begin`` to ``on_step_end`` (forward, backward, the decision,
clipping, the optimizer and the scheduler; not the Trainer's logging or saving, which come after).
The first step of each ``train()`` is left out (the Trainer's warm-up, the guard's first
snapshot). A round's ratio is the guarded median step over the plain median step; the table gives
the median ratio over rounds with its min-max (wall clock, and process CPU time, which moves
less on a shared machine), and the plain median step. Default config
(``configs/default.yaml``): eager activation hooks, sanitizer, fused gradient check, one host
sync per step; a snapshot every 100 healthy steps is amortized, not in a 20-step round.

Run: ``.venv/bin/python benchmarks/hf_overhead.py --rounds 7 --steps 20``
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from safetrain.integrations.huggingface import SafeTrainingCallback  # noqa: E402

MODELS: Dict[str, Dict[str, int]] = {
    "tiny": {"n_embd": 32, "n_layer": 2, "n_head": 2, "length": 16, "batch": 8},
    "small": {"n_embd": 256, "n_layer": 4, "n_head": 4, "length": 64, "batch": 8},
}


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, 1000, (n, length), generator=g)
        self.lens = torch.randint(length // 2, length + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        n = int(self.lens[i])
        ids, mask = self.ids[i].clone(), torch.zeros_like(self.ids[i])
        mask[:n], ids[n:] = 1, 0
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


class StepTimer(TrainerCallback):
    """Wall time and process CPU time of each optimizer step, ``on_step_begin`` to ``on_step_end``."""

    def __init__(self) -> None:
        self.wall: List[float] = []
        self.cpu: List[float] = []
        self._t = (0.0, 0.0)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self._t = (time.perf_counter(), time.process_time())

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.wall.append(time.perf_counter() - self._t[0])
        self.cpu.append(time.process_time() - self._t[1])


def run(model: torch.nn.Module, data: Tokens, spec: Dict[str, int], steps: int, guarded: bool, out: str) -> tuple:
    timer = StepTimer()
    callbacks: List[Any] = [timer]
    if guarded:
        callbacks.insert(0, SafeTrainingCallback({"log": {"level": "WARNING", "dir": out}}))
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=spec["batch"],
                             report_to="none", save_strategy="no", use_cpu=True, logging_steps=10**6,
                             disable_tqdm=True, learning_rate=1e-4, seed=0)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    if guarded and callbacks[0].result.healthy_steps != steps:
        raise RuntimeError(f"benchmark steps were not all healthy: {callbacks[0].result}")
    return statistics.median(timer.wall[1:]), statistics.median(timer.cpu[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the least noise on a shared machine)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    hf_logging.set_verbosity_error()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    rows = []
    for name in a.models.split(","):
        spec = MODELS[name]
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=1000, n_positions=spec["length"], n_embd=spec["n_embd"], n_layer=spec["n_layer"],
                         n_head=spec["n_head"], bos_token_id=1, eos_token_id=2)  # fmt: skip
        initial = GPT2LMHeadModel(cfg)
        data = Tokens(spec["batch"] * (a.steps + 1), spec["length"])
        ratios, cpu_ratios, plain = [], [], []
        with tempfile.TemporaryDirectory() as out:
            for r in range(a.rounds):
                times = {}
                for guarded in [False, True] if r % 2 == 0 else [True, False]:
                    times[guarded] = run(copy.deepcopy(initial), data, spec, a.steps, guarded, out)
                ratios.append(times[True][0] / times[False][0])
                cpu_ratios.append(times[True][1] / times[False][1])
                plain.append(times[False][0])
        rows.append((name, statistics.median(plain), ratios, cpu_ratios))
        print(f"{name}: wall ratios {', '.join(f'{x:.3f}' for x in ratios)}", flush=True)
        print(f"{name}: cpu ratios {', '.join(f'{x:.3f}' for x in cpu_ratios)}", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}\n")
    print("| model | plain step (median) | with SafeTrainingCallback: wall | process CPU time |")
    print("| --- | --- | --- | --- |")
    for name, step, wall, cpu in rows:
        cells = [f"{statistics.median(r):.3f}x ({min(r):.2f}-{max(r):.2f})" for r in (wall, cpu)]
        print(f"| {name} | {step * 1e3:.1f} ms | {' | '.join(cells)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
