"""Fixtures only; what the tests share otherwise lives in :mod:`tests.helpers`.

The fault injectors (``PoisonRows``, ``OutputFault``, ...) live in :mod:`safetrain.testing`.
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.helpers.models import regression_data

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def data() -> TensorDataset:
    return regression_data()


@pytest.fixture(params=["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def device(request: pytest.FixtureRequest) -> str:
    """Where a test that takes it puts its model: the CPU, and a CUDA device too where one is
    present (the engine's fault-injection tests and the replay's layer naming run there again)."""
    return request.param
