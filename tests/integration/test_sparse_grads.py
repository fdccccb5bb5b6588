"""Sparse gradients (issue 33): ``nn.Embedding(sparse=True)`` with ``torch.optim.SparseAdam`` or SGD.

A sparse embedding's gradient is a COO tensor: the fused norm ops most gradient code is written
with do not take it (``NotImplementedError: Could not run 'aten::_foreach_norm.Scalar' with
arguments from the 'SparseCPU' backend``, pytorch/tutorials#2245, from ``clip_grad_norm_``), nor
do dense element-wise ops (``clamp is not implemented for type torch.sparse.FloatTensor``,
allenai/allennlp#2312). The guard's gradient checks, clipping, zeroing and the replay that names a
broken gradient take its values instead; a healthy run is bitwise the plain loop's, and a NaN in
the sparse gradient is caught, named, and kept out of the weights.
"""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F

from safetrain import Guard, SafeTrainer, load_config

QUIET = ["log.progress=false", "snapshot.every=2"]


class Bag(torch.nn.Module):
    """A sparse embedding, averaged over a bag of ids, and a fixed projection (a buffer): every
    parameter has a sparse gradient, so SparseAdam can train the whole model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(40, 8, sparse=True)
        self.register_buffer("proj", torch.randn(8, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).mean(1) @ self.proj


def _batches(n: int = 8) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 40, (16, 4), generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


def _optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    if name == "sparse_adam":
        return torch.optim.SparseAdam(list(model.parameters()), lr=0.05)
    return torch.optim.SGD(model.parameters(), lr=0.5)


@pytest.mark.parametrize("name", ["sparse_adam", "sgd"])
def test_a_healthy_sparse_run_is_the_plain_loop_bitwise(name):
    """fit (start measurement, snapshots, checks) leaves the weights exactly where the plain loop does."""
    data = _batches()
    plain = Bag()
    opt = _optimizer(plain, name)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(plain(x), y).backward()
        opt.step()
    model = Bag()
    result = SafeTrainer(model, _optimizer(model, name), load_config(None, QUIET), loss_fn=F.mse_loss).fit(data)
    assert [e for e in result.events if e.name == "anomaly"] == []
    assert torch.equal(model.emb.weight, plain.emb.weight)


@pytest.mark.parametrize("name", ["sparse_adam", "sgd"])
def test_a_nan_in_a_sparse_gradient_is_caught_and_kept_out(name):
    """Step 4's sparse gradient holds NaN values (a hook on the embedding's gradient): the step is
    a ``gradient`` anomaly naming ``emb.weight``; its update never reaches the weights (before:
    the replay that names the gradient crashed on the COO tensor)."""
    model = Bag()
    step = {"now": 0}

    def poison(grad: torch.Tensor) -> torch.Tensor:
        if step["now"] != 4:
            return grad
        return torch.sparse_coo_tensor(grad._indices(), grad._values() * float("nan"), grad.shape)

    model.emb.weight.register_hook(poison)
    events = []
    with Guard(model, _optimizer(model, name), load_config(None, QUIET), loss_fn=F.mse_loss) as guard:
        for i, batch in enumerate(_batches()):
            step["now"] = i + 1
            before = model.emb.weight.detach().clone()
            result = guard.step(batch)
            events += result.events
            if i + 1 == 4:
                tripped = [e for e in result.events if e.kind == "gradient"]
                assert tripped, result
                assert "emb.weight" in tripped[0].message, tripped[0].message
                assert torch.isfinite(model.emb.weight).all()
                if not result.trained:
                    assert torch.equal(model.emb.weight, before)
    assert torch.isfinite(model.emb.weight).all()
    assert guard.counters.optimizer_steps >= 6


def test_clipping_a_sparse_gradient_scales_its_values():
    """``guard.clip_grad_norm`` on a sparse gradient: the update is the clipped one (the norm of
    the coalesced values), as ``clip_grad_norm_`` computes it for a dense copy."""
    model, ref = Bag(), Bag()
    x, y = _batches(1)[0]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with Guard(model, opt, load_config(None, [*QUIET, "guard.clip_grad_norm=0.01"]), loss_fn=F.mse_loss) as guard:
        assert guard.step((x, y)).trained
    F.mse_loss(ref(x), y).backward()
    dense = ref.emb.weight.grad.to_dense()
    expected = ref.emb.weight.detach() - dense * (0.01 / (dense.norm() + 1e-6))
    assert torch.allclose(model.emb.weight, expected, atol=1e-7)
