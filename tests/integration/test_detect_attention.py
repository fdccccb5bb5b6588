"""Eager detection on a Hugging Face GPT-2 under ``detect.granularity: block`` (issue 28).

One hook per transformer block stands for the dozen modules inside it on the healthy path; on a
trip the exact hooks of a re-run name the layer inside the block. What eager mode gives and lazy
mode does not must survive: a NaN in a row that never reaches the loss (a padded position, an
attention output row masked out of the loss) is caught at its step, and named where it starts.
The padded-row case is a public failure pattern: SDPA gives NaN for a query row whose keys are all
masked out (pytorch/pytorch#103749), and Hugging Face models returned NaN on exactly the padded
rows while the others stayed finite (huggingface/transformers#32390, Gemma 2 under SDPA).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import pytest
import torch

from safetrain import load_config
from safetrain.guard import Guard
from safetrain.testing import count_host_syncs

transformers = pytest.importorskip("transformers")

BASE = ["log.progress=false", "snapshot.every=1000", "recovery.escalate=[skip_batch]", "recovery.max_retries=20"]
SKIP_ALL = [f"recovery.actions.{k}=skip_batch" for k in ("forward", "loss", "gradient", "grad_norm")]


def tiny_gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def padded_batch(seed: int = 0) -> Dict[str, torch.Tensor]:
    """8 sequences of 16 tokens, right-padded (the first one to 10 tokens); labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (8, 16), generator=g)
    lens = torch.randint(10, 17, (8,), generator=g)
    lens[0] = 10
    mask = (torch.arange(16)[None, :] < lens[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, -100)}


class Spoil:
    """A forward hook putting NaN into a module's (first) output from its ``first``-th call on:
    everywhere, or only at ``row`` (batch row, position) of a ``(batch, seq, ...)`` output.
    Registered before the guard, so every monitor hook sees the spoiled output."""

    def __init__(self, module: torch.nn.Module, first: int = 2, row: Optional[tuple] = None) -> None:
        self.first, self.row, self.count = first, row, 0
        module.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, args: Any, out: Any) -> Any:
        self.count += 1
        if self.count < self.first:
            return None
        head = out[0] if isinstance(out, tuple) else out
        if self.row is None:
            bad = head + math.nan
        else:
            bad = head.clone()
            bad[self.row] = math.nan
        return (bad, *out[1:]) if isinstance(out, tuple) else bad


def run(model: torch.nn.Module, overrides: List[str], steps: int = 3) -> List[Any]:
    cfg = load_config(None, [*BASE, *SKIP_ALL, *overrides])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with Guard(model, opt, cfg) as guard:
        return [guard.step(padded_batch(seed=i)) for i in range(steps)]


def first_anomaly(results: List[Any]) -> Any:
    return next(e for r in results for e in r.events if e.name == "anomaly")


@pytest.mark.parametrize("granularity", ["block", "module"])
def test_nan_in_a_masked_out_attention_row_is_caught_and_named(granularity):
    model = tiny_gpt2()
    # sequence 0 is padding from position 10 on: its attention output row 15 feeds logits row 15,
    # which the causal shift drops from the loss; every other row stays finite
    Spoil(model.transformer.h[1].attn, first=2, row=(0, 15))
    results = run(model, [f"detect.granularity={granularity}"])
    assert results[0].action == "" and results[1].action == "skip_batch", [r.action for r in results]
    assert math.isfinite(results[1].loss), "the NaN row never reaches the loss"
    event = first_anomaly(results)
    assert event.kind == "forward", "caught by the activation hooks, not by the loss or the gradients"
    assert event.detail["finding"]["module"] == "transformer.h.1.attn", event.detail["finding"]
    assert event.detail["finding"]["module_type"] == "GPT2Attention"
    assert event.detail["diagnosis"]["module"] == "transformer.h.1.attn", event.detail["diagnosis"]


def test_lazy_mode_sees_the_masked_out_row_only_as_a_gradient():
    """The contrast that makes eager worth its cost: without hooks the same fault is a gradient
    anomaly (0 * NaN in the head's weight gradient), named at the layer only by the replay."""
    model = tiny_gpt2()
    Spoil(model.transformer.h[1].attn, first=2, row=(0, 15))
    event = first_anomaly(run(model, ["detect.mode=lazy"]))
    assert event.kind == "gradient", event


LAYERS = [
    "transformer.wte",
    "transformer.wpe",
    "transformer.h.0.ln_1",
    "transformer.h.0.attn.c_attn",
    "transformer.h.0.attn",
    "transformer.h.0.attn.c_proj",
    "transformer.h.0.ln_2",
    "transformer.h.0.mlp.c_fc",
    "transformer.h.0.mlp.act",
    "transformer.h.0.mlp.c_proj",
    "transformer.h.0.mlp",
    "transformer.h.1.mlp.c_proj",
    "transformer.ln_f",
    "lm_head",
]


def block_of(layer: str) -> str:
    parts = layer.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["transformer", "h"] else layer


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("where", ["everywhere", "masked row"])
def test_origin_under_blocks_equals_the_one_under_per_module_hooks(layer, where):
    """NaN everywhere, or in one padded row (which attention in a later layer may still spread to
    every row). When the loss trips too, the hooks' finding names the block and the replay the
    layer; when the loss stays finite, the exact re-run that confirms the flag names the layer."""
    named = {}
    for granularity in ("module", "block"):
        model = tiny_gpt2()
        row = None if where == "everywhere" or layer == "transformer.wpe" else (0, 15)
        Spoil(model.get_submodule(layer), first=2, row=row)  # every call from the second step's on
        results = run(model, [f"detect.granularity={granularity}"])
        event = first_anomaly(results)
        named[granularity] = (event.kind, event.detail["finding"]["module"], event.detail["diagnosis"]["module"])
    assert named["module"] == (named["module"][0], layer, layer), named
    kind, finding, origin = named["block"]
    assert (kind, origin) == (named["module"][0], layer), f"the origin named differs: {named}"
    loss_finite = math.isfinite(results[1].loss)
    assert finding == (layer if loss_finite else block_of(layer)), (named, loss_finite)


def test_transient_fault_inside_a_block_is_named_at_the_block():
    """The price of block hooks: a fault that a re-run does not reproduce is named at its block
    (per-module hooks would name the layer), and the replay calls it transient."""
    model = tiny_gpt2()
    calls = {"n": 0}

    def once(module: Any, args: Any, out: torch.Tensor) -> Optional[torch.Tensor]:
        calls["n"] += 1
        return out + math.nan if calls["n"] == 2 else None

    model.transformer.h[0].mlp.c_fc.register_forward_hook(once)
    event = first_anomaly(run(model, []))
    assert (event.kind, event.detail["finding"]["module"]) == ("forward", "transformer.h.0"), event.detail
    assert event.detail["diagnosis"]["reproducible"] is False


@pytest.mark.parametrize("granularity", ["block", "module"])
def test_one_host_sync_per_healthy_gpt2_step(granularity):
    """The guard adds one host sync to what the model makes itself (transformers' mask code reads
    the attention mask on the host)."""
    model = tiny_gpt2()
    with count_host_syncs() as own:
        model(**padded_batch(0)).loss.backward()
    model.zero_grad(set_to_none=True)
    cfg = load_config(None, [*BASE, f"detect.granularity={granularity}"])
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), cfg) as guard:
        guard.step(padded_batch(0))  # the first step's forced snapshot is no healthy step's cost
        for i in range(1, 4):
            with count_host_syncs() as syncs:
                result = guard.step(padded_batch(i))
            assert result.action == "" and syncs.count == own.count + 1, (i, own, syncs)
        assert len(guard.monitor.blocks) == (2 if granularity == "block" else 0)
