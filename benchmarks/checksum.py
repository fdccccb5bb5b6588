"""Snapshot checksum throughput on one thread: xxh3_64 (written since 0.2.0) against blocksum64 (0.1.0).

Each round checksums the same tensor with both, order alternating, ``torch.set_num_threads(1)``;
medians of GB/s over rounds, and the median of the per-round ratio xxh3_64 / blocksum64.

Usage::

    python benchmarks/checksum.py                   # 1, 64 and 256 MiB, 15 rounds
    python benchmarks/checksum.py --mib 16 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from safetrain.snapshot.checksums import blocksum64, xxh3_64  # noqa: E402


def _gbs(fn, t: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(t)
    return t.numel() * t.element_size() / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="1,64,256", help="tensor sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| size | xxh3_64 GB/s | blocksum64 GB/s | ratio xxh3/blocksum (min-max) |")
    print("|---|---|---|---|")
    for mib in (int(m) for m in args.mib.split(",")):
        t = torch.randn(mib * 2**18)
        xxh3_64(t), blocksum64(t)  # warm up
        new, old, ratio = [], [], []
        for r in range(args.rounds):
            pair = (xxh3_64, blocksum64) if r % 2 == 0 else (blocksum64, xxh3_64)
            got = {fn: _gbs(fn, t) for fn in pair}
            new.append(got[xxh3_64])
            old.append(got[blocksum64])
            ratio.append(got[xxh3_64] / got[blocksum64])
        print(
            f"| {mib} MiB | {statistics.median(new):.1f} | {statistics.median(old):.1f} | "
            f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) |"
        )


if __name__ == "__main__":
    main()
