"""Shared test helpers: small models and data, dispatch-mode checks, and skips for packages
that only one of the two test environments has (Composer: torch 2.7; Lightning: newest torch).

The model zoos live in :mod:`channels_last_algo.app.zoo`, shared with the benchmarks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import _python_dispatch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))  # `from conftest import ...` in test modules


class DropsNHWC(nn.Module):
    """A layer that hands its NHWC input on as NCHW: one break in forward."""

    def forward(self, x):
        return x.contiguous()


STRIDE_WARNING = 'Grad strides do not match bucket view strides'


def small_net() -> nn.Module:
    """For distributed tests: 3x3 conv + BN, a depthwise 3x3 (8x1x3x3: ambiguous), a 1x1 (16x8x1x1:
    ambiguous) + BN, a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.Conv2d(8, 16, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def breaking_model() -> nn.Module:
    """Conv, a layer that drops NHWC, conv, pool, linear head: exactly one break, at '1'."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        DropsNHWC(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def random_images(n: int = 16, size: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random NCHW images of ``size`` px and labels in 0..9, fixed by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=generator), torch.randint(0, 10, (n,), generator=generator)


def tiny_loader(n: int = 8, batch_size: int = 4) -> DataLoader:
    """A loader of ``n`` 16-px images in batches of ``batch_size``."""
    return DataLoader(TensorDataset(*random_images(n)), batch_size=batch_size)


def no_dispatch_mode() -> bool:
    """True when no TorchDispatchMode (the audit's) is installed."""
    return _python_dispatch._get_current_dispatch_mode() is None


@pytest.fixture
def double_precision():
    """float64 as the default dtype for one test, for comparisons exact enough to mean something."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
