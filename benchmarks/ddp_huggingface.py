"""Overhead of ``SafeTrainingCallback`` in a real ``transformers.Trainer`` under DDP: 2 gloo ranks
under ``torchrun`` (accelerate's ``DistributedDataParallel``, CPU), against the same Trainer
without it, on the same model and data (GPT-2 built from a config, random weights).

The script launches itself under ``torch.distributed.run --nproc_per_node 2``. Each round trains
both variants for ``--steps`` optimizer steps (one ``trainer.train()`` each, the same initial
weights, the order rotated from round to round); a callback times every step from
``on_step_begin`` to ``on_step_end`` (forward, backward with DDP's all-reduce, the decision with
its one collective, clipping, optimizer, scheduler), the first step of each ``train()`` left
out. A variant's time in a round is the slower rank's median step; a round's ratio is guarded
over plain; the table gives the median ratio over rounds with its min-max, and the plain median
step. A last, untimed round counts host syncs per step (``safetrain.testing.count_host_syncs``)
in both variants: the callback must add exactly one (the step's read, which carries the
agreement across ranks).

Run: ``.venv/bin/python benchmarks/ddp_huggingface.py --rounds 7 --steps 20``
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MODELS: Dict[str, Dict[str, int]] = {
    "tiny": {"n_embd": 32, "n_layer": 2, "n_head": 2, "length": 16, "batch": 8},
    "small": {"n_embd": 256, "n_layer": 4, "n_head": 4, "length": 64, "batch": 8},
}


def _rank_main(a: argparse.Namespace) -> None:
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    from safetrain.integrations.huggingface import SafeTrainingCallback
    from safetrain.testing import count_host_syncs

    torch.set_num_threads(a.threads)
    hf_logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int, length: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(3, 1000, (n, length), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}

    class StepTimer(TrainerCallback):
        def __init__(self, count: bool) -> None:
            self.wall: List[float] = []
            self.syncs: List[int] = []
            self.count, self._t, self._counter = count, 0.0, None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.count:
                self._counter = count_host_syncs()
                self._seen = self._counter.__enter__()
            self._t = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.wall.append(time.perf_counter() - self._t)
            if self._counter is not None:
                self._counter.__exit__(None, None, None)
                self.syncs.append(self._seen.count)
                self._counter = None

    def run(spec: Dict[str, int], guarded: bool, out: str, count: bool = False) -> Tuple[float, List[int]]:
        torch.manual_seed(0)
        cfg = GPT2Config(vocab_size=1000, n_positions=spec["length"], n_embd=spec["n_embd"], n_layer=spec["n_layer"],
                         n_head=spec["n_head"], bos_token_id=1, eos_token_id=2)  # fmt: skip
        timer = StepTimer(count)
        callbacks: List[Any] = [timer]
        if guarded:
            callbacks.insert(0, SafeTrainingCallback({"log": {"level": "WARNING", "dir": out}}))
        args = TrainingArguments(output_dir=out, max_steps=a.steps, per_device_train_batch_size=spec["batch"],
                                 report_to="none", save_strategy="no", use_cpu=True, logging_steps=10**6,
                                 disable_tqdm=True, learning_rate=1e-4, seed=0, ddp_backend="gloo")  # fmt: skip
        data = Tokens(spec["batch"] * 2 * (a.steps + 1), spec["length"])
        Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=data, callbacks=callbacks).train()
        if guarded and callbacks[0].result.healthy_steps != a.steps:
            raise RuntimeError(f"benchmark steps were not all healthy: {callbacks[0].result}")
        return statistics.median(timer.wall[1:]), timer.syncs[1:]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"rank{dist.get_rank() if dist.is_initialized() else 0}")
        for name in a.models.split(","):
            spec = MODELS[name]
            ratios, plain = [], []
            for r in range(a.rounds):
                times = {}
                for guarded in [False, True] if r % 2 == 0 else [True, False]:
                    mine = run(spec, guarded, out)[0]
                    every = [None, None]
                    dist.all_gather_object(every, mine)
                    times[guarded] = max(every)  # the slower rank's median step
                ratios.append(times[True] / times[False])
                plain.append(times[False])
            syncs = {g: run(spec, g, out, count=True)[1] for g in (False, True)}
            rows.append((name, statistics.median(plain), ratios, syncs))
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__}, 2 ranks, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
        for name, _, ratios, syncs in rows:
            print(f"{name}: ratios {', '.join(f'{x:.3f}' for x in ratios)}")
            print(f"{name}: host syncs per step, plain {sorted(set(syncs[False]))}, guarded {sorted(set(syncs[True]))}")
        print("\n| model | plain DDP step (median) | with SafeTrainingCallback | host syncs per step added |")
        print("| --- | --- | --- | --- |")
        for name, step, r, syncs in rows:
            added = sorted({g - p for g, p in zip(syncs[True], syncs[False])})
            print(
                f"| {name} | {step * 1e3:.1f} ms | {statistics.median(r):.3f}x ({min(r):.2f}-{max(r):.2f}) | {added} |"
            )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,small")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    a = p.parse_args()
    if "RANK" in os.environ:
        _rank_main(a)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           *sys.argv[1:]]  # fmt: skip
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.call(cmd, env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(a.threads)))


if __name__ == "__main__":
    sys.exit(main())
