"""The late-view wrappers' cost: a guarded training step after the watched ones, with and without them.

While a training step runs unwatched, ``Tensor.view`` and ``Tensor.view_as`` are thin wrappers that start
the watch where NHWC strides refuse a view (channels_last_algo/core/late_views.py); a view that succeeds
costs one Python call more. Here each model is converted by a :class:`LayoutGuard`, its first (watched)
step runs, and then rounds interleave two variants of a later step (forward, cross entropy, backward):

    armed       the guard's step as it is: the wrappers on for the forward and backward
    unarmed     the same step, the wrappers taken off right after it starts

The cost is the median over rounds of the paired difference, in ms and as a share of the unarmed step;
the views a step makes from Python are counted once.

Example:
    flock /tmp/channels_last_timing.lock .venv-newest/bin/python benchmarks/late_views.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Optional

import torch
import zoo_models as zoo  # benchmarks/, next to this script
from arguments import parse_step_args
from results_writer import main_over_models, markdown_report, median_and_min
from torch import nn
from torch.overrides import TorchFunctionMode

from channels_last_algo.core import late_views
from channels_last_algo.core.guard import LayoutGuard

# a ResNet (one view a step) and timm's hybrids that view windows and heads (tens to hundreds a step)
MODELS = ('resnet50', 'maxvit_pico_rw_256', 'coatnet_pico_rw_224', 'tiny_vit_5m_224', 'halonet26t')
VARIANTS = ('armed', 'unarmed')


class _CountViews(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.views = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.views += late_views.original(func) in (torch.Tensor.view, torch.Tensor.view_as)
        return func(*args, **(kwargs or {}))


def _stepper(model: nn.Module, guard: LayoutGuard, batch_size: int, image_size: int) -> Callable[..., float]:
    """The seconds of one guarded training step of ``model`` in a variant (``around``: a mode over its forward and
    backward), on a fixed batch."""
    torch.manual_seed(1)
    images = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(0, 100, (batch_size,))

    def step(variant: str, around: Optional[TorchFunctionMode] = None) -> float:
        start = time.perf_counter()
        batch = guard.on_batch((images, labels))
        guard.on_step_start()
        if variant == 'unarmed':
            late_views.disarm(guard._viewed)
        with around or contextlib.nullcontext():  # the forward and backward only: the guard's modes come and go outside
            nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        guard.on_step_end()
        guard.on_batch_end()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def measure(name: str, args: argparse.Namespace) -> dict:
    entry = zoo.by_name(name)
    model = zoo.build(entry, num_classes=100)
    guard = LayoutGuard()
    guard.on_init(model)
    step = _stepper(
        model, guard, args.batch_size, entry.input_shape[-1] if args.image_size is None else args.image_size
    )
    step('armed')  # the first training step: watched
    counter = _CountViews()
    step('unarmed', around=counter)
    times = {variant: [] for variant in VARIANTS}
    for _ in range(args.warmup + args.rounds):
        for variant in VARIANTS:
            times[variant].append(step(variant))
    guard.close()
    times = {v: s[args.warmup :] for v, s in times.items()}
    extra = statistics.median(a - u for a, u in zip(times['armed'], times['unarmed']))
    unarmed = statistics.median(times['unarmed'])
    return {
        'model': name,
        'views_per_step': counter.views,
        'step_ms': {v: 1e3 * statistics.median(s) for v, s in times.items()},
        'step_min_ms': {v: 1e3 * min(s) for v, s in times.items()},
        'extra_ms': 1e3 * extra,
        'extra_share_of_a_step': extra / unarmed,
    }


def markdown(result: dict) -> str:
    s = result['settings']
    intro = (
        f'float32, batch {s["batch_size"]}, each model at its zoo size unless --image-size; forward, cross entropy '
        f'and backward through the guard after its watched first step; {s["rounds"]} rounds after {s["warmup"]} '
        'warm-up, the variants interleaved. Medians (min) in ms. "extra" is the median over rounds of the paired '
        'difference, armed minus unarmed; noise of either sign at this size.'
    )
    columns = ['model', 'views a step:', 'armed:', 'unarmed:', 'extra:', 'extra / step:']
    return markdown_report(
        result,
        "The late-view wrappers' cost: a guarded training step after the watched ones",
        intro,
        columns,
        lambda row: [
            row['model'],
            str(row['views_per_step']),
            *(median_and_min(row, 'step', variant) for variant in VARIANTS),
            f'{row["extra_ms"]:+.2f}',
            f'{row["extra_share_of_a_step"]:+.3f}',
        ],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_step_args(
        __doc__,
        argv,
        'late_views',
        MODELS,
        zoo.installed(MODELS),
        rounds=15,
        warmup=2,
        image_size_help="default: each model's zoo size (64 px)",
    )


def main(argv: list[str] | None = None) -> int:
    def line(row: dict) -> str:
        return (
            f'{row["model"]:<22} {row["views_per_step"]:>4} views, extra {row["extra_ms"]:+.2f} ms of {row["step_ms"]}'
        )

    return main_over_models('late_views', argv, parse_args, measure, line, markdown)


if __name__ == '__main__':
    sys.exit(main())
