"""Loss spikes with no clipping, fixed clipping and adaptive (ZClip) clipping, recovery on in each.

A small causal transformer LM (2 pre-LN layers, d=64, 4 heads) on synthetic token sequences from
a random sparse Markov chain (learnable, the same for every run of a seed), trained with SGD
(momentum 0.9; ``--optimizer adamw`` for AdamW) and no LR warm-up for ``--steps`` steps at each
``--lrs`` (by default 0.3, where every variant trains quietly, and 3.0, where an unclipped run
spikes), over ``--seeds``. Variants, each through ``SafeTrainer.fit`` with the default
configuration (spike, divergence, the end check and the recovery ladder on; replays off):

- ``none``: no clipping;
- ``fixed``: ``guard.clip_grad_norm=1.0``;
- ``adaptive``: ``guard.clip.mode=adaptive`` (ZClip's defaults: z 2.5, alpha 0.97, 25 warm-up steps).

The junk scenario (``--junk-lr``, default 0.3: a healthy LR) puts gradient outliers after
adaptive's warm-up, where real LM runs meet them: the batches of steps ``--junk-steps``
(40, 60, 80, 100, the same for every variant and seed) are boilerplate, a short loop of likely
tokens (a token that likely follows itself, or a likely pair or triple) repeated over every row,
a different loop each time, like a separator line, a table template or a duplicated page that a
corpus' dedup and repetition filters missed. Its loss is 0.4-1.3x a normal batch's (the text
is predictable, so the loss-spike detector sees nothing), but every position pushes the weights
the same way: the total gradient norm is 10-25x a normal batch's (probe at step 47, 3 seeds:
normal 0.57-0.63, junk 6.4-15.7).

Per (scenario, variant): loss spikes the guard saw (its ``spike`` anomalies), all anomalies, restores,
skipped steps, clipped steps, runs aborted (an abort includes the end check: a run that ends
worse than it started), the final loss (held-out, median over seeds, min-max) and the step time
against ``none`` (median of the per-seed ratios; noisy on a shared machine). Prints a markdown
table. Nothing here is timed in a test. (AdamW at LRs up to 0.3 and post-LN layers made no spike
in runs this short: Adam's normalised update hides the gradient's scale.)

Run: ``.venv/bin/python benchmarks/spikes.py`` (3 seeds x (2 LRs + the junk scenario) x 3 variants x 120 steps).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # before torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import safetrain  # noqa: E402

VOCAB, SEQ, BATCH = 64, 32, 16
OPTIMIZER = {"name": "sgd"}  # set by --optimizer
JUNK_ROWS = {"rows": BATCH}  # set by --junk-rows
VARIANTS = {
    "none": [],
    "fixed": ["guard.clip_grad_norm=1.0"],
    "adaptive": ["guard.clip.mode=adaptive"],
}


class TinyLM(nn.Module):
    """A 2-layer pre-norm causal transformer language model."""

    post_norm = False  # post-LN layers (set by --post-norm)

    def __init__(self, d: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d, heads, 2 * d, dropout=0.0, batch_first=True, norm_first=not self.post_norm
        )
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        return self.head(self.norm(self.body(self.embed(x) + self.pos[:n], mask=mask, is_causal=True)))


def markov_data(seed: int, n: int) -> torch.Tensor:
    """``n`` sequences of ``SEQ + 1`` tokens from a random sparse Markov chain (4 likely successors a token)."""
    g = torch.Generator().manual_seed(1000 + seed)
    logits = torch.randn(VOCAB, VOCAB, generator=g)
    top = logits.topk(4, dim=1).indices
    probs = torch.full((VOCAB, VOCAB), 0.02 / VOCAB)
    probs.scatter_(1, top, 0.98 / 4)
    seqs = torch.empty(n, SEQ + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        seqs[:, t + 1] = torch.multinomial(probs[seqs[:, t]], 1, generator=g).squeeze(1)
    return seqs


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def successors(seed: int) -> torch.Tensor:
    """The Markov chain of :func:`markov_data`'s 4 likely successors of each token, ``(VOCAB, 4)``."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(VOCAB, VOCAB, generator=g).topk(4, dim=1).indices


def boilerplate(seed: int, n: int) -> List[List[int]]:
    """``n`` short loops of likely transitions in the seed's chain, shortest first (a token that
    likely follows itself, a likely ``a b a`` pair, a likely three-token loop): text the model
    predicts well, like a separator line or a table template's repeated cells."""
    nxt = [set(row.tolist()) for row in successors(seed)]
    found: List[List[int]] = []
    for length in (1, 2, 3):
        for a in range(VOCAB):
            paths = [[a]]
            for _ in range(length - 1):
                paths = [p + [b] for p in paths for b in nxt[p[-1]] if b > a]  # a: the loop's lowest token
            found += [p for p in paths if a in nxt[p[-1]] and len(set(p)) == length]
            if len(found) >= n:
                return found[:n]
    raise ValueError(f"seed {seed}: fewer than {n} likely loops of up to 3 tokens in the chain")


def junk_batches(batches: List[tuple], seed: int, at: List[int], rows: int) -> List[tuple]:
    """``batches`` with the batches of steps ``at`` (1-based) made outliers: their first ``rows``
    sequences become a piece of boilerplate (:func:`boilerplate`, a different one each time) repeated over the whole
    sequence, every row alike: a duplicated page of a separator line or a table template that a
    web-corpus dedup or repetition filter missed. Its loss is *lower* than a normal batch's (the
    text is predictable), but every position pushes the weights the same way, so the gradient
    norm is 10-20x a normal batch's: an outlier of the gradient that the loss does not show."""
    out = list(batches)
    for step, cycle in zip(at, boilerplate(seed, len(at))):
        text = torch.tensor((cycle * (SEQ + 1))[: SEQ + 1])
        if 0 < step <= len(out):
            x, y = (t.clone() for t in out[step - 1])
            x[:rows], y[:rows] = text[:-1], text[1:]
            out[step - 1] = (x, y)
    return out


def run(seed: int, lr: float, variant: str, steps: int, junk: Optional[List[int]] = None) -> Dict[str, Any]:
    """One training run (``junk``: the steps whose batch is an outlier, :func:`junk_batches`);
    returns its counts, held-out loss and seconds per step."""
    data = markov_data(seed, steps * BATCH + 256)
    train, held = data[: steps * BATCH], data[steps * BATCH :]
    batches = [(s[:, :-1], s[:, 1:]) for s in train.split(BATCH)]
    if junk:
        batches = junk_batches(batches, seed, junk, JUNK_ROWS["rows"])
    torch.manual_seed(seed)
    model = TinyLM()
    if OPTIMIZER["name"] == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    overrides = ["log.progress=false", "log.level=ERROR", "detect.replay.enabled=false", *VARIANTS[variant]]
    cfg = safetrain.load_config(None, overrides)
    trainer = safetrain.SafeTrainer(model, opt, cfg, loss_fn=lm_loss)
    t0 = time.perf_counter()
    aborted = False
    try:
        result = trainer.fit(batches, epochs=1)
    except safetrain.TrainingAborted as exc:
        result, aborted = exc.result, True
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        final = float(lm_loss(model(held[:, :-1]), held[:, 1:]))
    anomalies = [e for e in result.events if e.name == "anomaly"]
    return {
        "spikes": sum(1 for e in anomalies if e.kind == "spike"),
        "anomalies": len(anomalies),
        "restores": result.restores,
        "skipped": result.skipped_batches,
        "clipped": result.clipped_steps,
        "aborted": aborted,
        "final": final if math.isfinite(final) else math.inf,
        "step_s": seconds / max(result.steps, 1),
    }


def table(results: Dict[tuple, List[Dict[str, Any]]], scenarios: List[str], seeds: int) -> str:
    head = (
        "| LR | variant | loss spikes | anomalies | restores | skipped steps | clipped steps | aborted "
        "| final loss, median (min-max) | step time vs none |"
    )
    lines = [head, "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for sc in scenarios:
        for v in VARIANTS:
            runs = results[(sc, v)]
            finals = [r["final"] for r in runs]
            ratio = statistics.median(r["step_s"] / b["step_s"] for r, b in zip(runs, results[(sc, "none")]))
            lines.append(
                f"| {sc} | {v} | {sum(r['spikes'] for r in runs)} | {sum(r['anomalies'] for r in runs)} "
                f"| {sum(r['restores'] for r in runs)} | {sum(r['skipped'] for r in runs)} "
                f"| {sum(r['clipped'] for r in runs)} | {sum(r['aborted'] for r in runs)}/{seeds} "
                f"| {statistics.median(finals):.3f} ({min(finals):.3f}-{max(finals):.3f}) | {ratio:.2f}x |"
            )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Run every (seed, LR, variant) and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lrs", default="0.3,3.0", help="comma-separated learning rates")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="sgd: momentum 0.9")
    parser.add_argument("--post-norm", action="store_true", help="post-LN layers (less stable without warm-up)")
    parser.add_argument("--junk-lr", type=float, default=0.3, help="the junk scenario's LR (0: no junk scenario)")
    parser.add_argument("--junk-steps", default="40,60,80,100", help="steps whose batch is boilerplate junk")
    parser.add_argument("--junk-rows", type=int, default=BATCH, help="rows of a junk batch that are junk")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.getLogger("safetrain").setLevel(logging.ERROR)
    lrs = [float(x) for x in args.lrs.split(",") if x]
    junk = [int(x) for x in args.junk_steps.split(",") if x]
    TinyLM.post_norm = args.post_norm
    OPTIMIZER["name"] = args.optimizer
    JUNK_ROWS["rows"] = args.junk_rows
    # (label, LR, junk steps): the clean runs at each LR, then the junk scenario
    scenarios = [(f"{lr:g}", lr, []) for lr in lrs]
    if args.junk_lr > 0 and junk:
        scenarios.append((f"{args.junk_lr:g} + {len(junk)} junk", args.junk_lr, junk))
    results: Dict[tuple, List[Dict[str, Any]]] = {(sc[0], v): [] for sc in scenarios for v in VARIANTS}
    started = time.perf_counter()
    for seed in range(args.seeds):
        for label, lr, at in scenarios:
            for v in VARIANTS:  # interleaved: the machine's load hits each variant alike
                results[(label, v)].append(run(seed, lr, v, args.steps, at))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.seeds} seeds x {len(scenarios)} "
        f"scenarios x {len(VARIANTS)} variants x {args.steps} steps, {time.perf_counter() - started:.0f} s"
    )
    print(table(results, [sc[0] for sc in scenarios], args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
