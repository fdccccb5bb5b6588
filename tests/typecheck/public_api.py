"""Checked by mypy in CI (``.ci/run``; config in pyproject.toml), never run: a user's code against the
public API, so that the lazy exports of ``safetrain/__init__.py`` type as what they are, not ``object``
(issue 35: ``"object" not callable`` under mypy before their ``TYPE_CHECKING`` imports)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

import safetrain


def fit_once(loader: Iterable[Any]) -> safetrain.FitResult:
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = safetrain.SafeTrainer(model, optimizer, safetrain.load_config(None, ["log.progress=false"]))
    guard: safetrain.Guard = safetrain.Guard(model, optimizer)
    del guard
    return trainer.fit(loader)
