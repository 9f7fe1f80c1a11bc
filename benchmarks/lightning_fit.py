"""Lightning benchmark: training-step time inside ``Trainer.fit``, NCHW and channels last, side by side.

Variants of each model, from the same weights, on the same batches, interleaved round by round in
one process (channels_last_algo.core.timing); a turn is one ``Trainer.fit`` of ``--steps`` steps:

    nchw            no callback: the model as built, NCHW batches
    channels_last   what a Lightning user writes by hand (Lightning has no channels-last switch):
                    model.to(memory_format=channels_last) before fit, and the images made NHWC
                    in training_step (timm's --channels-last)
    ours            ChannelsLastCallback()
    ours_auto       ChannelsLastCallback(mode='auto'), which times both layouts before training

Only training steps are timed, from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
cross-entropy, backward and an SGD step), and not a fit's first step. A fit's setup and what a
callback does before the first step (the conversion, the repair check, auto mode's trial steps) are
not: they run once per training, not per step. Reported: min and median ms per step and the median
of the per-round ratios over NCHW with its 95% interval.

    python benchmarks/lightning_fit.py --out benchmarks/results/cpu-2core    # resnet50 and mobilenet_v3_large
    python benchmarks/lightning_fit.py --models resnet18 --rounds 2 --steps 2 --batch-size 4    # a minute
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time

import lightning as L
import torch
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from results_writer import RunStart, finish
from zoo_models import build, by_name
from zoo_report import cell, measure_each, timed_row

from channels_last_algo import ChannelsLastCallback
from channels_last_algo.core.machine_description import machine_label
from channels_last_algo.core.timing import time_interleaved

VARIANTS = ('nchw', 'channels_last', 'ours', 'ours_auto')


class _Classifier(L.LightningModule):
    """``network`` trained with cross-entropy and SGD with momentum; NHWC images in ``training_step``
    where ``nhwc_inputs``."""

    def __init__(self, network: torch.nn.Module, nhwc_inputs: bool) -> None:
        super().__init__()
        self.network, self.nhwc_inputs = network, nhwc_inputs

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if self.nhwc_inputs:
            images = images.contiguous(memory_format=torch.channels_last)
        return torch.nn.functional.cross_entropy(self.network(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepClock(L.Callback):
    """A clock (call it) that runs only inside training steps after a fit's first: the seconds from
    ``on_train_batch_start`` to ``on_train_batch_end`` of those steps, summed.

    Example:
        >>> clock = StepClock()
        >>> clock()
        0.0
    """

    def __init__(self) -> None:
        self.total, self.started = 0.0, None

    def __call__(self) -> float:
        return self.total

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.started = time.perf_counter() if batch_idx > 0 else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.started is not None:
            self.total += time.perf_counter() - self.started


def _fits(model_name: str, args: argparse.Namespace, clock: StepClock) -> dict:
    """A call per variant that trains a fresh copy of the model ``args.steps`` steps in a fresh Trainer."""
    base = build(by_name(model_name), num_classes=10)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(args.steps * args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, 10, (len(images),), generator=generator)
    data = torch.utils.data.TensorDataset(images, labels)

    def fit(name: str) -> None:
        network = copy.deepcopy(base)
        if name == 'channels_last':
            network = network.to(memory_format=torch.channels_last)
        callbacks = [clock]
        if name.startswith('ours'):
            callbacks.append(ChannelsLastCallback(mode='auto' if name == 'ours_auto' else 'on'))
        trainer = L.Trainer(
            accelerator='cpu',
            devices=1,
            max_steps=args.steps,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
        trainer.fit(_Classifier(network, nhwc_inputs=name == 'channels_last'), loader)

    return {name: (lambda name=name: fit(name)) for name in VARIANTS}


def measure(model_name: str, args: argparse.Namespace) -> dict:
    clock = StepClock()
    timings = time_interleaved(_fits(model_name, args, clock), rounds=args.rounds, warmup=1, catch=True, timer=clock)
    return timed_row(model_name, timings, steps_per_call=args.steps - 1)


def markdown(result: dict) -> str:
    s, load = result['settings'], result['load_average_1min']
    lines = [
        '# Lightning: training step time inside Trainer.fit, NCHW and channels last: '
        + machine_label(result['machine']),
        '',
        f'{result["machine"]["cpu"]}, torch {result["machine"]["torch"]}, Lightning {L.__version__}. '
        f'{result["date"]}, {result["seconds"] / 60:.0f} minutes. Command: `{result["command"]}`',
        '',
        f'Batch {s["batch_size"]} x {s["image_size"]} px, float32, {s["threads"]} torch threads, SGD with momentum; '
        f'each turn one fit of {s["steps"]} steps, its first untimed; {s["rounds"]} timed rounds after one '
        f'warm-up round, variants interleaved. 1-minute load average {load["before"]:.1f} before, '
        f'{load["after"]:.1f} after. Cells: median ms per step (min), and the median of per-round ratios '
        'over NCHW, its 95% interval, + / - beyond a 2% tie band.',
        '',
        '| model | ' + ' | '.join(VARIANTS) + ' | fastest | errors |',
        '|---|' + '---:|' * len(VARIANTS) + '---|---|',
    ]
    for row in result['rows']:
        cells = []
        for name in VARIANTS:
            ms = row['ms'].get(name)
            ratio = f' {cell(row["ratios"][name])}' if name in row['ratios'] else ''
            cells.append(f'{ms["median"]:.0f} ({ms["min"]:.0f}){ratio}' if ms else '')
        errors = '; '.join(f'{k}: {v}' for k, v in row['errors'].items())
        lines.append(f'| {row["model"]} | ' + ' | '.join(cells) + f' | {row["fastest"]} | {errors} |')
    return '\n'.join(lines) + '\n'


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(6),
        threads=Option(2),
        out='results folder (lightning_fit.json and .md); none: printed only',
        epilog=False,
    )
    parser.add_argument('--models', nargs='+', default=['resnet50', 'mobilenet_v3_large'])
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--image-size', type=int, default=112)
    parser.add_argument('--steps', type=int, default=4, help='steps per fit, the first untimed (at least 2)')
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f'--steps {args.steps}: a fit needs a step after its first to time; give 2 or more')
    return args


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    logging.getLogger('lightning.pytorch').setLevel(logging.WARNING)  # not the banner of every fit
    rows = measure_each(args.models, args.threads, lambda name: measure(name, args))
    finish('lightning_fit', start, argv, args, rows, markdown)
    return 0


if __name__ == '__main__':
    sys.exit(main())
