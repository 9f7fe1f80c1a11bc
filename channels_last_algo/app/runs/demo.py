"""A short demonstration: train a small residual conv net in NCHW and with channels last.

It prints the layout of the weights, the input, an activation and a weight gradient in each
variant, the training-step times measured side by side (interleaved rounds, min and median),
and the speedup as the median of the paired per-step ratios with its interval, which says how
far the noise of so few steps reaches. It is a demonstration, not a benchmark: see
``benchmarks/`` for the measured claims.

Example (what ``channels-last demo`` runs)::

    run_demo(steps=20, batch_size=32, image_size=64)
"""

from __future__ import annotations

import copy
import functools
import statistics

import torch
from torch import nn

from channels_last_algo.app.runs.speedups import interval_words
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layout import layout_of
from channels_last_algo.core.timing import Ratio, Timings, time_interleaved

__all__ = ['TinyResNet', 'run_demo', 'speedup_line']


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
    """Conv, BN, ReLU, max pooling, two residual blocks, global pooling and a linear head.

    Example:
        >>> TinyResNet(num_classes=10)(torch.randn(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

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


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    optimizer.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()


def _print_layouts(
    name: str, model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor
) -> None:
    """One training step (the variant's warm-up), then the layouts of a weight, the input, an activation and
    the weight's gradient."""
    activation = {}
    handle = model.blocks[0].register_forward_hook(lambda mod, inp, out: activation.setdefault('out', out))
    _train_step(model, optimizer, images, labels)
    handle.remove()
    weight = model.blocks[0].conv1.weight
    print(
        f'{name:<15} {layout_of(weight).value:<8} {layout_of(images).value:<8} '
        f'{layout_of(activation["out"]).value:<11} {layout_of(weight.grad).value:<11}'
    )


def run_demo(steps: int = 20, batch_size: int = 32, image_size: int = 64, seed: int = 0) -> dict[str, list[float]]:
    """Train :class:`TinyResNet` in both layouts, print layouts and step times; return the times.

    ValueError naming the argument when ``steps`` or ``batch_size`` is below 1 or ``image_size``
    below 2 (the stem's max pooling halves it)."""
    _check_demo_arguments(steps=steps, batch_size=batch_size, image_size=image_size)
    torch.manual_seed(seed)
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, 10, (batch_size,))

    baseline = TinyResNet()
    converted = copy.deepcopy(baseline)
    guard = LayoutGuard()
    guard.on_init(converted)
    variants = {
        'NCHW': (baseline, images),
        'channels last': (converted, guard.on_batch(images)),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, (m, _) in variants.items()}

    print(
        f'torch {torch.__version__}, {torch.get_num_threads()} threads, '
        f'batch {batch_size} x 3 x {image_size} x {image_size}'
    )
    print(f'{"variant":<15} {"weight":<8} {"input":<8} {"activation":<11} {"weight grad":<11}')
    for name, (model, x) in variants.items():
        _print_layouts(name, model, optimizers[name], x, labels)

    timings = time_interleaved(
        {
            name: functools.partial(_train_step, model, optimizers[name], x, labels)
            for name, (model, x) in variants.items()
        },
        rounds=steps,
        warmup=0,
    )
    _print_times(timings, steps)
    return timings.seconds


def _check_demo_arguments(**arguments: int) -> None:
    """ValueError naming the argument when ``steps`` or ``batch_size`` is below 1 or ``image_size`` below 2."""
    for name, least in (('steps', 1), ('batch_size', 1), ('image_size', 2)):
        value = arguments[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f'{name} must be an int >= {least}, got {value!r}')


def _print_times(timings: Timings, steps: int) -> None:
    """Each variant's min and median step time, and the speedup line."""
    print(f'\n{"variant":<15} {"min ms":>8} {"median ms":>10}   ({steps} interleaved steps)')
    for name, samples in timings.seconds.items():
        print(f'{name:<15} {min(samples) * 1e3:8.2f} {statistics.median(samples) * 1e3:10.2f}')
    print(speedup_line(timings.ratio('NCHW', 'channels last')))


def speedup_line(ratio: Ratio) -> str:
    """The demo's speedup, with the steps it rests on and how far their noise reaches.

    Example:
        >>> speedup_line(Ratio(1.3, 0.05, None, 3, 0.95))  # doctest: +ELLIPSIS
        'channels last vs NCHW: 1.30x, the median of 3 paired steps; too few steps for an interval...'
    """
    return (
        f'channels last vs NCHW: {ratio.median:.2f}x, the median of {ratio.rounds} paired steps; '
        f'{interval_words(ratio.interval, "--steps", ratio.confidence)}. '
        'A few steps on a shared machine are noisy: a demonstration, not a measurement (see benchmarks/)'
    )
