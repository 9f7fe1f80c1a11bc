"""The repair check's cost: the first training step of a converted model with and without the check.

The layout guard compares each layer a repair rule swapped with its original on the layer's first
call (channels_last_algo/core/repair_check.py): two more forward and backward passes of that layer,
once. Here each round builds a fresh converted copy of the model per variant (untimed) and times its
first training step (forward, cross entropy or MSE loss, backward):

    rules           apply_channels_last(model): the swapped layers, unchecked
    rules+check     the same, with a RepairCheck following the step

then a second step of the checked copy, when the check no longer runs (nothing left to check: its
hooks are off). Rounds interleave the variants, so load slows both alike. The cost is the median
over rounds of the paired difference of the first steps, in ms and as a share of a later step.

Example:
    flock /tmp/channels_last_timing.lock .venv-newest/bin/python benchmarks/repair_check.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import zoo_models as zoo  # benchmarks/, next to this script
from arguments import parse_step_args
from results_writer import main_over_models, markdown_report, median_and_min
from torch import nn

from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.repair_check import RepairCheck

# torchvision and local models that a repair rule changes on the CPU, and timm ones where timm is installed
MODELS = ('mobilenet_v2', 'shufflenet_v2_x1_0', 'convnext_tiny', 'unet', 'resnest14d', 'ghostnet_050', 'convnext_atto')


def _step(name: str, batch_size: int, image_size: int) -> Callable[[nn.Module], float]:
    """The seconds of one training step of a model on a fixed batch."""
    torch.manual_seed(1)
    images = torch.randn(batch_size, 3, image_size, image_size).to(memory_format=torch.channels_last)
    target = torch.randn(batch_size, 3, 2 * image_size, 2 * image_size) if name == 'unet' else None
    labels = torch.randint(0, 100, (batch_size,))

    def step(model: nn.Module) -> float:
        start = time.perf_counter()
        output = model(images)
        loss = (
            nn.functional.mse_loss(output, target)
            if target is not None
            else nn.functional.cross_entropy(output, labels)
        )
        loss.backward()
        return time.perf_counter() - start

    return step


def measure(name: str, args: argparse.Namespace) -> dict:
    entry = zoo.by_name(name)
    base = zoo.build(entry, num_classes=None if entry.source == 'local' else 100)
    summary = apply_channels_last(base)
    step = _step(name, args.batch_size, args.image_size)
    first = {'rules': [], 'rules+check': []}
    later = []
    for _ in range(args.warmup + args.rounds):
        for variant in first:
            model = copy.deepcopy(base)
            check = RepairCheck(model, summary.repaired) if variant == 'rules+check' else None
            if check is not None:
                check.start()
            first[variant].append(step(model))
            if check is not None:
                assert check.done and not check.refused, check.refused
                later.append(step(model))
    first = {v: s[args.warmup :] for v, s in first.items()}
    later = later[args.warmup :]
    extra = statistics.median(c - r for c, r in zip(first['rules+check'], first['rules']))
    return {
        'model': name,
        'rules': sorted({r.reason for r in summary.repaired}),
        'checked_layers': len(summary.repaired),
        'first_step_ms': {v: 1e3 * statistics.median(s) for v, s in first.items()},
        'first_step_min_ms': {v: 1e3 * min(s) for v, s in first.items()},
        'later_step_ms': 1e3 * statistics.median(later),
        'extra_ms': 1e3 * extra,
        'extra_share_of_a_step': extra / statistics.median(later),
    }


def markdown(result: dict) -> str:
    s = result['settings']
    intro = (
        f'float32, batch {s["batch_size"]} x 3 x {s["image_size"]} x {s["image_size"]}, forward and backward; '
        f'{s["rounds"]} rounds after {s["warmup"]} warm-up, each on fresh copies, interleaved. Medians (min) in ms. '
        '"extra" is the median over rounds of the paired difference of the first steps; the check runs on '
        'the first call of each swapped layer only, so later steps pay nothing.'
    )
    columns = [
        'model',
        'rules',
        'layers checked:',
        'first step, rules:',
        'first step, rules + check:',
        'extra:',
        'a later step:',
        'extra / later step:',
    ]
    return markdown_report(
        result,
        "The repair check's cost: the first training step with and without it",
        intro,
        columns,
        lambda row: [
            row['model'],
            ', '.join(row['rules']),
            str(row['checked_layers']),
            median_and_min(row, 'first_step', 'rules'),
            median_and_min(row, 'first_step', 'rules+check'),
            f'{row["extra_ms"]:.1f}',
            f'{row["later_step_ms"]:.1f}',
            f'{row["extra_share_of_a_step"]:.2f}',
        ],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return parse_step_args(
        __doc__,
        argv,
        'repair_check',
        MODELS,
        zoo.installed(MODELS),
        rounds=7,
        warmup=1,
        image_size=64,
        min_image_size=32,
    )


def main(argv: list[str] | None = None) -> int:
    def line(row: dict) -> str:
        return f'{row["model"]:<20} extra {row["extra_ms"]:.1f} ms, a later step {row["later_step_ms"]:.1f} ms'

    return main_over_models('repair_check', argv, parse_args, measure, line, markdown)


if __name__ == '__main__':
    sys.exit(main())
