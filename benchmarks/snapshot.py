"""Snapshot throughput: memory store vs a raw copy, safetensors store vs torch.save/torch.load.

For a model of N float32 parameters with Adam state (3N floats in all), measures in one process,
variants interleaved and their order rotated each round:

* memory: ``MemoryStore.save`` (capture, finiteness check, copy into reused buffers) against a
  raw ``torch._foreach_copy_`` of the same tensors into preallocated buffers (target >= 0.8),
  with ``keep=2`` (the default: copy and check in one pass) and ``keep=1`` (check, then copy);
  the finiteness check alone is reported too, since on the CPU it is a full extra read;
* save: ``SafetensorsStore.save`` (check, CRC32, write, fsync, rename) against ``torch.save``
  of the model and optimizer state dicts to a file, flushed and fsynced (target: not slower);
* load: ``load_snapshot`` (read, verify checksums, check names/shapes, restore in place)
  against ``torch.load(weights_only=True)`` + ``load_state_dict`` for model and optimizer.

Loads read files the page cache holds unless ``--cold`` (then each file is evicted with
``posix_fadvise(DONTNEED)`` first). Medians, with min-max over rounds.

Usage::

    python benchmarks/snapshot.py                      # 50M and 200M parameters, 5 rounds
    python benchmarks/snapshot.py --params 10 --rounds 3
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import argparse  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable, Dict, List  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from safetrain.snapshot import MemoryStore, SafetensorsStore, TrainState, load_snapshot  # noqa: E402
from safetrain.snapshot.tensors import nonfinite  # noqa: E402


def build(n_params: int) -> TrainState:
    """Linear layers of 2048x2048 (4.2M parameters each) up to ``n_params``, with Adam state."""
    width = 2048
    layers = max(1, round(n_params / (width * width + width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # creates exp_avg and exp_avg_sq
    for p in model.parameters():
        p.grad = None
    return TrainState(model, opt)


def state_bytes(state: TrainState) -> int:
    params = sum(p.numel() * p.element_size() for p in state.model.parameters())
    moments = sum(
        t.numel() * t.element_size() for s in state.optimizer.state.values() for t in s.values() if t.dim() > 0
    )
    return params + moments


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rounds(
    variants: Dict[str, Callable[[], object]], n: int, between: Callable[[], object] = lambda: None
) -> Dict[str, List[float]]:
    """Run every variant once per round, rotating their order; ``between`` runs untimed before each."""
    names = list(variants)
    times: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(n):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            between()
            gc.collect()
            times[name].append(timed(variants[name]))
    return times


def report(title: str, nbytes: int, times: Dict[str, List[float]], pairs: List[tuple]) -> None:
    print(f"  {title}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"    {name:<28} {med * 1e3:9.1f} ms  ({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f})"
            f"  {nbytes / med / 1e9:6.2f} GB/s"
        )
    for ours, base, label in pairs:
        per_round = [b / o for o, b in zip(times[ours], times[base])]
        ratio = statistics.median(times[base]) / statistics.median(times[ours])
        print(f"    {label:<28} {ratio:9.2f}x  (per round {min(per_round):.2f}-{max(per_round):.2f})")


def bench_memory(state: TrainState, nbytes: int, n: int) -> None:
    # keep=2 (the default): with an older snapshot kept, copy and check are one pass.
    # keep=1: the one snapshot must survive a refusal, so everything is checked before the copy.
    store, single = MemoryStore(keep=2), MemoryStore(keep=1)
    counters = {"step": 1, "epoch": 0, "batch": 1}
    for s in (store, store, single):
        s.save(state, counters)  # allocates every slot's buffers once
    src = [p.detach() for p in state.model.parameters()]
    src += [t for s in state.optimizer.state.values() for t in s.values() if t.dim() > 0]
    dst = [torch.empty_like(t) for t in src]
    torch._foreach_copy_(dst, src)  # first touch (page faults) untimed, as the store's first save was
    named = [(str(i), t) for i, t in enumerate(src)]
    times = rounds(
        {
            "raw _foreach_copy_": lambda: torch._foreach_copy_(dst, src),
            "MemoryStore.save": lambda: store.save(state, counters),
            "MemoryStore(keep=1).save": lambda: single.save(state, counters),
            "finiteness check alone": lambda: nonfinite(named),
        },
        n,
    )
    report(
        "memory snapshot",
        nbytes,
        times,
        [
            ("MemoryStore.save", "raw _foreach_copy_", "memory / raw copy"),
            ("MemoryStore(keep=1).save", "raw _foreach_copy_", "keep=1 / raw copy"),
        ],
    )
    store.close()
    single.close()
    dst.clear()  # frees the copies


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_files(state: TrainState, nbytes: int, n: int, directory: str, cold: bool) -> None:
    store = SafetensorsStore(os.path.join(directory, "st"), keep=1)
    torch_path = os.path.join(directory, "state.pt")
    counters = {"step": 1, "epoch": 0, "batch": 1}

    # Both variants write a new file while the previous one exists, and neither is timed deleting
    # the previous one: SafetensorsStore unlinks rotated files in a background thread (waited for
    # by drain(), untimed), torch.save's old file is removed before the timed call.
    def untimed_cleanup() -> None:
        store.drain()
        if os.path.exists(torch_path):
            os.remove(torch_path)

    def torch_save() -> None:
        with open(torch_path, "wb") as f:
            torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def torch_load() -> None:
        if cold:
            _evict(torch_path)
        sd = torch.load(torch_path, weights_only=True)
        state.model.load_state_dict(sd["model"])
        state.optimizer.load_state_dict(sd["optimizer"])

    def ours_load() -> None:
        path = store.paths()[-1]
        if cold:
            _evict(path)
        load_snapshot(path, state)

    times = rounds(
        {"torch.save + fsync": torch_save, "SafetensorsStore.save": lambda: store.save(state, counters)},
        n,
        between=untimed_cleanup,
    )
    report("save to disk", nbytes, times, [("SafetensorsStore.save", "torch.save + fsync", "safetensors / torch.save")])
    torch_save()  # the file torch_load reads
    times = rounds({"torch.load + load_state_dict": torch_load, "load_snapshot": ours_load}, n)
    report(
        "load from disk" + (" (cold)" if cold else " (page cache)"),
        nbytes,
        times,
        [("load_snapshot", "torch.load + load_state_dict", "safetensors / torch.load")],
    )
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="50,200", help="model sizes in millions of float32 parameters")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per variant")
    parser.add_argument("--dir", default=None, help="where to write files (default: a temporary dir under /tmp)")
    parser.add_argument("--cold", action="store_true", help="evict files from the page cache before each load")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: memory, files")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    for millions in (float(x) for x in args.params.split(",")):
        state = build(int(millions * 1e6))
        nbytes = state_bytes(state)
        n_params = sum(p.numel() for p in state.model.parameters())
        print(f"\n{n_params / 1e6:.0f}M parameters + Adam state: {nbytes / 1e9:.2f} GB")
        if "memory" not in skip:
            bench_memory(state, nbytes, args.rounds)
        if "files" not in skip:
            directory = tempfile.mkdtemp(prefix="safetrain-bench-", dir=args.dir or "/tmp")
            try:
                bench_files(state, nbytes, args.rounds, directory, args.cold)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
        del state
        gc.collect()


if __name__ == "__main__":
    main()
