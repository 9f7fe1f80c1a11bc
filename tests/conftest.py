"""Shared test helpers: small models and data, dispatch-mode checks, and skips for packages
that only one of the two test environments has (Composer: torch 2.7; Lightning: newest torch).

The tests live in three folders: ``core/`` (the layout engine, ``channels_last_algo.core``; these never
import ``channels_last_algo.app`` nor ``benchmarks``, which ``app/test_package.py`` checks), ``integrations/``
(Composer, Lightning, Accelerate, distributed, compile) and ``app/`` (the CLI, recipes, data, runs, the
benchmarks and the package). A helper module lives in the folder of the tests that import it
(``core/guarded_runs.py``, ``app/recipe_runs.py``, ``app/image_folders.py``); pytest's default import mode
puts a test module's own folder on ``sys.path``, so it is imported by its plain name, and test module
names are unique across the folders. This module, shared by all three, puts this folder (for
``from conftest import ...``) and the repository root (for ``benchmarks``, which only ``app/`` tests
import) on ``sys.path``, and both on ``PYTHONPATH`` for the child processes of tests, which run test
modules as scripts (rank programs) and import the package from any working directory.
"""

from __future__ import annotations

import os
import socket
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils import _python_dispatch
from torch.utils.data import DataLoader, TensorDataset

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Child processes of tests (rank programs, models checked in a subprocess) import the package and this
# module as the tests do, from any working directory: a checkout run with PYTHONPATH=. (a GPU machine's)
# gets the checkout's absolute path in front. This folder comes first: `conftest` is this module, not the
# repository root's conftest.py (doctest collection).
os.environ['PYTHONPATH'] = os.pathsep.join(
    dict.fromkeys(
        [str(TESTS), str(ROOT)]
        + [str(Path(entry).resolve()) for entry in os.environ.get('PYTHONPATH', '').split(os.pathsep) if entry]
    )
)
sys.path.insert(0, str(ROOT))  # `from benchmarks import ...` (app/ tests only), from any working directory
sys.path.insert(0, str(TESTS))  # `from conftest import ...` in test modules, in any of the three folders


def free_port() -> int:
    """A TCP port free now on this machine, for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def lightning_trainer(callbacks=(), **options):
    """A ``lightning.Trainer`` on one CPU that writes and prints nothing of its own (no logger,
    checkpoints, progress bar, model summary or sanity validation); ``options`` add or override."""
    import lightning as L

    quiet = dict(
        accelerator='cpu',
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(callbacks=list(callbacks), **{**quiet, **options})


def channels_last_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of an NHWC tensor of ``shape``."""
    return torch.empty(shape, memory_format=torch.channels_last, device='meta').stride()


def nhwc_bucket_views(bucket) -> dict[tuple[int, ...], bool]:
    """For each 4D parameter of a DDP gradient bucket: whether its gradient, read back from the
    bucket's bytes with NHWC strides, equals the rank's gradient (DDP's bucket view for it is NHWC)."""
    buffer, offset, seen = bucket.buffer(), 0, {}
    for param in bucket.parameters():
        if param.dim() == 4:
            segment = buffer[offset : offset + param.numel()]
            seen[tuple(param.shape)] = torch.equal(
                segment.as_strided(param.shape, channels_last_strides(param.shape)), param.grad
            )
        offset += param.numel()
    return seen


class DropsNHWC(nn.Module):
    """A layer that hands its NHWC input on as NCHW: one break in forward."""

    def forward(self, x):
        return x.contiguous()


class BackToChannelsLast(nn.Module):
    """A layer that makes its NCHW input NHWC again, inside the model: one break in forward."""

    def forward(self, x):
        return x.to(memory_format=torch.channels_last)


def forward_break_net() -> nn.Module:
    """Two breaks in forward, at ``body.1`` (NHWC -> NCHW) and ``body.2`` (back to NHWC); importable by
    name for the ``channels-last audit`` command (``conftest:forward_break_net``)."""
    body = nn.Sequential(nn.ReLU(), DropsNHWC(), BackToChannelsLast(), nn.Conv2d(8, 4, 3))
    return nn.Sequential(OrderedDict(stem=nn.Conv2d(3, 8, 3, padding=1), body=body))


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


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(x + self.bn2(self.conv2(out)))


class TinyResNet(nn.Module):
    """Conv, BN, ReLU, max pooling, two residual blocks, global pooling and a linear head: the demo's
    model (``channels_last_algo.app.runs.demo.TinyResNet``), here for the core tests, which import nothing
    of the application; ``app/test_package.py`` checks that the two stay the same model."""

    def __init__(self, num_classes: int = 10, width: int = 32, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.blocks = nn.Sequential(_Block(width), _Block(width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.blocks(self.stem(x))), 1))


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
