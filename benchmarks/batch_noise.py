"""Noise drawn like the batch: a guarded training step that leaves the batch tensor as it comes, against one that
keeps it NHWC and so watches every step.

torch's CPU generators fill memory in its order, so ``torch.randn_like(images)`` of an NHWC batch puts other numbers
on each pixel than NCHW does. A diffusion model's step (``noisy = a * images + b * randn_like(images)``) and noise
augmentation (randomized smoothing: ``images + sigma * randn_like(images)``) draw so. The guard draws such noise in
NCHW's order while it watches, and where the batch tensor is one it made NHWC, leaves it as it comes from the next
batch on, so no later step is watched. Four variants of the same step, interleaved, each on its own copy of the model:

    nchw            no package, the batch as it comes
    channels_last   Composer's one line: model and batch to channels last (the noise falls elsewhere than in NCHW)
    kept_nhwc       the guard with inputs='all': the batch NHWC as asked, so the noise is drawn under the watch
    left            the guard as it is (inputs='auto'): the batch left as it comes after the first step

Example:
    flock /tmp/channels_last_timing.lock .venv-newest/bin/python benchmarks/batch_noise.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
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
from torch.nn import functional as F

from channels_last_algo.core.guard import LayoutGuard

# a denoising UNet (its output at twice the input's size, pooled back) and a classifier trained on noised images
MODELS = ('unet', 'resnet50', 'efficientnet_b0')
VARIANTS = ('nchw', 'channels_last', 'kept_nhwc', 'left')


def _loss(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A denoiser's loss on images noised at a random level, or a classifier's on images noised as augmentation."""
    noise = torch.randn_like(images)
    if labels.dim() == 0:  # a denoiser
        level = torch.rand(images.size(0), 1, 1, 1)
        predicted = model(images * (1 - level).sqrt() + noise * level.sqrt())
        return F.mse_loss(F.avg_pool2d(predicted, predicted.size(-1) // images.size(-1)), noise)
    return F.cross_entropy(model(images + 0.25 * noise), labels)


def _stepper(model: nn.Module, variant: str, images: torch.Tensor, labels: torch.Tensor) -> Callable[[], float]:
    """The seconds of one training step of ``variant``'s copy of ``model`` (forward, loss, backward, SGD step)."""
    model = copy.deepcopy(model)
    guard: Optional[LayoutGuard] = None
    if variant == 'channels_last':
        model = model.to(memory_format=torch.channels_last)
    elif variant in ('kept_nhwc', 'left'):
        guard = LayoutGuard(audit_steps=0, inputs='all' if variant == 'kept_nhwc' else 'auto')
        guard.on_init(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        start = time.perf_counter()
        batch = (
            (images.to(memory_format=torch.channels_last), labels) if variant == 'channels_last' else (images, labels)
        )
        if guard is None:
            _loss(model, *batch).backward()
        else:
            batch = guard.on_batch(batch)
            with guard.step():
                _loss(model, *batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if guard is not None:
            guard.on_batch_end()
        return time.perf_counter() - start

    return step


def measure(name: str, args: argparse.Namespace) -> dict:
    entry = zoo.by_name(name)
    model = zoo.build(entry) if entry.source == 'local' else zoo.build(entry, num_classes=100)
    size = entry.input_shape[-1] if args.image_size is None else args.image_size
    torch.manual_seed(1)
    images = torch.randn(args.batch_size, 3, size, size)
    labels = torch.tensor(0) if entry.source == 'local' else torch.randint(0, 100, (args.batch_size,))
    steps = {variant: _stepper(model, variant, images, labels) for variant in VARIANTS}
    for step in steps.values():
        step()  # the first training step: the guard's is watched
    times = {variant: [] for variant in VARIANTS}
    for _ in range(args.warmup + args.rounds):
        for variant, step in steps.items():
            times[variant].append(step())
    times = {v: s[args.warmup :] for v, s in times.items()}
    ratios = [k / left for k, left in zip(times['kept_nhwc'], times['left'])]
    return {
        'model': name,
        'image_size': size,
        'step_ms': {v: 1e3 * statistics.median(s) for v, s in times.items()},
        'step_min_ms': {v: 1e3 * min(s) for v, s in times.items()},
        'left_over_kept_nhwc': statistics.median(ratios),
        'left_over_nchw': statistics.median(n / left for n, left in zip(times['nchw'], times['left'])),
    }


def markdown(result: dict) -> str:
    s = result['settings']
    intro = (
        f'float32, batch {s["batch_size"]}; forward, loss, backward and SGD step, each variant on its own copy of the '
        f'model after its first step; {s["rounds"]} rounds after {s["warmup"]} warm-up, the variants interleaved. '
        'Medians (min) in ms. "left vs kept" and "left vs NCHW" are medians of the paired per-round speedups of the '
        "guard as it is (the batch left as it comes) over the guard with inputs='all' (every step watched) and over "
        "NCHW. Composer's one line draws the noise in NHWC order: other numbers than NCHW's."
    )
    columns = [
        'model',
        'px:',
        'NCHW:',
        "Composer's one line:",
        "inputs='all':",
        'as it is:',
        'left vs kept:',
        'left vs NCHW:',
    ]
    return markdown_report(
        result,
        'Noise drawn like the batch: the batch left as it comes, against every step watched',
        intro,
        columns,
        lambda row: [
            row['model'],
            str(row['image_size']),
            *(median_and_min(row, 'step', variant) for variant in VARIANTS),
            f'{row["left_over_kept_nhwc"]:.2f}x',
            f'{row["left_over_nchw"]:.2f}x',
        ],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_step_args(
        __doc__,
        argv,
        'batch_noise',
        MODELS,
        zoo.installed(MODELS),
        rounds=15,
        warmup=2,
        image_size_help="default: each model's zoo size",
    )


def main(argv: list[str] | None = None) -> int:
    def line(row: dict) -> str:
        return f'{row["model"]:<16} left vs kept {row["left_over_kept_nhwc"]:.2f}x, step ms {row["step_ms"]}'

    return main_over_models('batch_noise', argv, parse_args, measure, line, markdown)


if __name__ == '__main__':
    sys.exit(main())
