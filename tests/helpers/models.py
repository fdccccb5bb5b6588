"""The tiny fixtures most tests build: a learnable regression set, a small tanh MLP, a seeded loader."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["finite_params", "loader", "mlp", "model_with_grads", "regression_data", "unscaled_regression"]


def regression_data(n: int = 256, d: int = 8, seed: int = 0) -> TensorDataset:
    """A learnable synthetic regression set: y = x @ w + small noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g) / d**0.5  # unit-variance targets
    y = x @ w + 0.05 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def mlp(d: int = 8, hidden: int = 16, seed: int = 0) -> nn.Module:
    """A ``d``-``hidden``-1 tanh MLP, seeded: the model of ``regression_data``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def loader(dataset: Dataset, batch_size: int = 16, seed: int = 0, shuffle: bool = True) -> DataLoader:
    """Batches of ``dataset`` in a seeded order."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))


def finite_params(model: nn.Module) -> bool:
    """Whether every parameter of ``model`` is finite."""
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def model_with_grads(seed: int = 0) -> nn.Module:
    """A 4-8-2 tanh MLP, seeded, with the gradients of one backward in its parameters."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model


def unscaled_regression(n: int = 256, d: int = 8, scale: float = 10.0, seed: int = 0) -> TensorDataset:
    """Features of standard deviation ``scale`` (not normalized): plain SGD is stable only below lr 1/scale**2."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * scale
    y = x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)
