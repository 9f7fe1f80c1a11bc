"""The optimizer step pre-hook's cost: an optimizer step of a converted model, with and without the hook.

While a converted model lives, one process-wide step pre-hook keeps each optimizer's gradients and state in
their weights' strides (channels_last_algo/core/optimizer_state_layout.py): before every step of a fused or
third-party optimizer (a stride comparison per 4D/5D tensor), once after each ``load_state_dict`` for torch's
other steps. Here each model is converted, given gradients, stepped once (its state made), and rounds then
interleave two variants of ``optimizer.step()``:

    hook        the step as it is: the pre-hook runs
    no hook     the same step, the hook idle (as once no converted model lives)

The cost is the median over rounds of the paired difference, in microseconds and as a share of the step
without the hook.

Example:
    flock /tmp/channels_last_timing.lock .venv-newest/bin/python benchmarks/optimizer_state_layout.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable

import torch
import zoo_models as zoo  # benchmarks/, next to this script
from arguments import Option, benchmark_parser
from results_writer import RunStart, finish, markdown_report, median_and_min

from channels_last_algo.core import optimizer_state_layout
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.timing import time_interleaved

MODELS = ('resnet50', 'efficientnet_b0', 'convnext_tiny')
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    'AdamW fused': lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    'AdamW': lambda params: torch.optim.AdamW(params, lr=1e-3),
    'SGD fused': lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
}
VARIANTS = ('hook', 'no hook')


def _hook_for(variant: str, holders: int) -> None:
    """The hook working (``'hook'``) or idle, as once no converted model lives (``'no hook'``)."""
    optimizer_state_layout._holders[0] = holders if variant == 'hook' else 0


def measure(name: str, optimizer_name: str, args: argparse.Namespace) -> dict:
    model = zoo.build(zoo.by_name(name), num_classes=100)
    apply_channels_last(model)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3  # in p's layout, as a backward gives it
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    optimizer.step()  # the state made
    holders = optimizer_state_layout._holders[0]
    try:
        timings = time_interleaved(
            {variant: optimizer.step for variant in VARIANTS},
            rounds=args.rounds,
            warmup=args.warmup,
            prepare=functools.partial(_hook_for, holders=holders),
        )
    finally:
        optimizer_state_layout._holders[0] = holders
    hook, bare = timings.seconds['hook'], timings.seconds['no hook']
    extra = statistics.median(a - b for a, b in zip(hook, bare))
    return {
        'model': name,
        'optimizer': optimizer_name,
        'tensors_4d': sum(p.dim() == 4 for p in model.parameters()),
        'step_ms': {v: 1e3 * timings.median(v) for v in VARIANTS},
        'step_min_ms': {v: 1e3 * timings.min(v) for v in VARIANTS},
        'extra_us': 1e6 * extra,
        'extra_share_of_a_step': extra / timings.median('no hook'),
    }


def markdown(result: dict) -> str:
    s = result['settings']
    intro = (
        f'float32, each model converted by apply_channels_last, its gradients set, one step taken first; '
        f'{s["rounds"]} rounds after {s["warmup"]} warm-up, the variants interleaved. Medians (min) of the '
        'optimizer step in ms. "extra" is the median over rounds of the paired difference, hook minus no hook, '
        'in microseconds; noise of either sign at this size.'
    )
    columns = ['model', 'optimizer', '4D weights:', 'hook:', 'no hook:', 'extra (us):', 'extra / step:']
    return markdown_report(
        result,
        "The optimizer step pre-hook's cost: an optimizer step of a converted model",
        intro,
        columns,
        lambda row: [
            row['model'],
            row['optimizer'],
            str(row['tensors_4d']),
            *(median_and_min(row, 'step', variant, digits=2) for variant in VARIANTS),
            f'{row["extra_us"]:+.0f}',
            f'{row["extra_share_of_a_step"]:+.3f}',
        ],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__, warmup=Option(3), rounds=Option(30), out='folder for the .json and .md', epilog=False
    )
    parser.add_argument('--models', nargs='+', default=zoo.installed(MODELS), choices=MODELS, metavar='MODEL')
    parser.add_argument('--optimizers', nargs='+', default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error('need --rounds >= 1 and --warmup >= 0')
    return args


def main(argv: list[str] | None = None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    rows = []
    for name in args.models:
        for optimizer_name in args.optimizers:
            rows.append(measure(name, optimizer_name, args))
            row = rows[-1]
            print(f'{name:<16} {optimizer_name:<12} extra {row["extra_us"]:+.0f} us of {row["step_ms"]}')
    finish('optimizer_state_layout', start, argv, args, rows, markdown)
    return 0


if __name__ == '__main__':
    sys.exit(main())
