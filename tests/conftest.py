"""Shared test helpers: small models and data, dispatch-mode checks, and skips for packages
that only one of the two test environments has (Composer: torch 2.7; Lightning: newest torch).

The model zoos live with the benchmarks, in ``benchmarks/zoo_models.py`` (outside the installed
package); this module puts the repository root on ``sys.path`` and imports them as ``zoo``, so
``from conftest import zoo`` works under pytest and in a test module run as a script.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import _python_dispatch
from torch.utils.data import DataLoader, TensorDataset

# Child processes of tests (rank programs, models checked in a subprocess) import the package as the
# tests do, from any working directory: a checkout run with PYTHONPATH=. (a GPU machine's) gets the
# checkout's absolute path in front.
os.environ['PYTHONPATH'] = os.pathsep.join(
    [str(Path(__file__).resolve().parent.parent)]
    + [str(Path(entry).resolve()) for entry in os.environ.get('PYTHONPATH', '').split(os.pathsep) if entry]
)
sys.path.insert(0, str(Path(__file__).parent))  # `from conftest import ...` in test modules
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `from benchmarks import ...`, from any folder

from benchmarks import zoo_models as zoo  # noqa: E402, F401  (the zoos, for `from conftest import zoo`)


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


def leave_rank() -> None:
    """End a test's rank program after its record is saved: wait for every rank, then exit at once.

    Not interpreter exit, nor ``destroy_process_group()``: the gloo group's destructor can join a worker
    thread that waits for the GIL it holds (a hang, torch 2.7) or abort the rank ("terminate called
    without an active exception", torch 2.14), both seen under load.

    Example: ``torch.save(record, out / f'rank{rank}.pt'); leave_rank()``
    """
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture
def double_precision():
    """float64 as the default dtype for one test, for comparisons exact enough to mean something."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
