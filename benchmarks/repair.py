"""Training-step time of the model zoo in NCHW, plain channels last, and channels last + repair.

Three variants of each model start from the same weights and train on the same batches:

    NCHW        the model as built, NCHW input
    CL          apply_channels_last(model, repair=False), NHWC input: restrided weights only
    CL+repair   the same, then repair_model(model) (what repair=True does), NHWC input

One training step is forward, loss (cross entropy on random labels; for the UNet, MSE against
a random target in the input's layout), backward, SGD step with momentum. After warm-up
steps, each round times one step of every variant of a model in turn, so that load from
other work on the machine slows all three alike; min and median over rounds are reported,
and "repair vs CL" is the median over rounds of the CL step time over the CL+repair step
time of the same round (above 1: repair is faster). A layout audit of one more step of each
variant counts its layout breaks (forward and backward).

Example:
    flock /tmp/channels_last_timing.lock .venv/bin/python benchmarks/repair.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from collections.abc import Callable

import torch
import zoo_models as zoo  # benchmarks/, next to this script
from arguments import Option, benchmark_parser
from results_writer import RunStart, finish
from torch import nn

from channels_last_algo.core.audit import LayoutAudit
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import RULES, RepairRule, repair_model
from channels_last_algo.core.timing import time_interleaved

ZOO = tuple(entry.name for entry in zoo.TORCHVISION_ZOO)
VARIANTS = ('NCHW', 'CL', 'CL+repair')


def build(name: str) -> nn.Module:
    entry = zoo.by_name(name)
    return zoo.build(entry, num_classes=None if entry.source == 'local' else 100)


def variants(name: str, rules: tuple[RepairRule, ...] = RULES) -> tuple[dict[str, nn.Module], list[str]]:
    """The three variants of model ``name`` (repaired with ``rules``), and the rules applied."""
    base = build(name)
    plain = copy.deepcopy(base)
    apply_channels_last(plain, repair=False)
    repaired = copy.deepcopy(base)
    apply_channels_last(repaired, repair=False)  # repaired below with the chosen rules
    applied = sorted({record.reason for record in repair_model(repaired, rules=rules)})
    return {'NCHW': base, 'CL': plain, 'CL+repair': repaired}, applied


def make_step(name: str, model: nn.Module, nhwc: bool, batch_size: int, image_size: int) -> Callable[[], None]:
    """One training step of ``model`` on a fixed batch, as a function."""
    torch.manual_seed(1)
    images = torch.randn(batch_size, 3, image_size, image_size)
    if name == 'unet':
        target = torch.randn(batch_size, 3, 2 * image_size, 2 * image_size)
    else:
        target = torch.randint(0, 100, (batch_size,))
    if nhwc:
        images = images.to(memory_format=torch.channels_last)
        target = target.to(memory_format=torch.channels_last) if target.dim() == 4 else target
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        output = model(images)
        if name == 'unet':
            loss = nn.functional.mse_loss(output, target)
        else:
            outputs = output if isinstance(output, tuple) else (output,)  # GoogLeNet's aux heads
            loss = sum(nn.functional.cross_entropy(o, target) for o in outputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(name: str, args: argparse.Namespace, only_rule: str | None = None) -> dict:
    """Step times and layout breaks of the three variants; ``only_rule`` repairs with that rule alone."""
    rules = RULES if only_rule is None else tuple(r for r in RULES if r.name == only_rule)
    models, applied = variants(name, rules)
    steps = {v: make_step(name, models[v], v != 'NCHW', args.batch_size, args.image_size) for v in VARIANTS}
    timings = time_interleaved(steps, rounds=args.rounds, warmup=args.warmup)
    seconds = timings.seconds
    breaks, outside = {}, {}
    for variant in VARIANTS:
        with LayoutAudit(models[variant]) as audit:
            steps[variant]()
        breaks[variant] = len(audit.report.breaks)
        outside[variant] = len(audit.report.outside)

    return {
        'model': name if only_rule is None else f'{name} ({only_rule} only)',
        'rules': applied,
        'seconds': seconds,
        'min_ms': {v: 1e3 * min(s) for v, s in seconds.items()},
        'median_ms': {v: 1e3 * statistics.median(s) for v, s in seconds.items()},
        'cl_vs_nchw': timings.ratio('NCHW', 'CL').median,
        'repair_vs_cl': timings.ratio('CL', 'CL+repair').median,
        'repair_vs_nchw': timings.ratio('NCHW', 'CL+repair').median,
        'layout_breaks': breaks,
        'breaks_outside_model': outside,
    }


def markdown(result: dict) -> str:
    m, s = result['machine'], result['settings']
    lines = [
        '# Repair: training step time, NCHW vs channels last vs channels last + repair',
        '',
        f'Machine: {m["cpu"]}, {m["cores_usable"]} usable cores ({m["cores"]} online), '
        f'{m["torch_threads"]} torch threads, GPU: {m["gpu"] or "none"}.',
        f'torch {m["torch"]}, torchvision {m["torchvision"]}, oneDNN {m["onednn"]}, Python {m["python"]}.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after the run (other work on the machine makes steps vary).',
        '',
        f'float32, batch {s["batch_size"]} x 3 x {s["image_size"]} x {s["image_size"]} (UNet output at twice '
        f'that), SGD with momentum; {s["rounds"]} timed steps per variant after {s["warmup"]} warm-up steps, '
        'interleaved. Medians and minimums in ms. The ratios are medians over rounds of paired step times '
        '(above 1: the second variant is faster). Where no rule applies, CL and CL+repair run the same code, '
        'so their ratio shows the noise of the run. Breaks: layout breaks the audit finds in one training step '
        '(forward, loss, backward, optimizer step), with those outside the model (in the loss) in brackets; '
        'the NCHW variant of ConvNeXt counts the NHWC tensors that its own permutes create.',
        '',
        '| model | NCHW | CL | CL+repair | CL vs NCHW | repair vs CL | repair vs NCHW | breaks CL | '
        'breaks repaired | rules applied |',
        '|---|---:|---:|---:|---:|---:|---:|---:|---:|---|',
    ]
    for row in result['rows']:
        med, low = row['median_ms'], row['min_ms']
        cells = [f'{med[v]:.0f} (min {low[v]:.0f})' for v in VARIANTS]
        breaks = []
        for variant in ('CL', 'CL+repair'):
            outside = row['breaks_outside_model'][variant]
            breaks.append(f'{row["layout_breaks"][variant]}' + (f' ({outside} outside)' if outside else ''))
        lines.append(
            f'| {row["model"]} | {" | ".join(cells)} | {row["cl_vs_nchw"]:.2f}x | {row["repair_vs_cl"]:.2f}x | '
            f'{row["repair_vs_nchw"]:.2f}x | {" | ".join(breaks)} | {", ".join(row["rules"]) or "-"} |'
        )
    return '\n'.join(lines) + '\n'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        warmup=Option(2),
        rounds=Option(9),
        out='folder for repair.json and repair.md',
        epilog=False,
    )
    parser.add_argument('--models', nargs='+', default=list(ZOO), choices=ZOO, metavar='MODEL')
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--image-size', type=int, default=64)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.image_size < 64 or args.batch_size < 2:
        parser.error(
            'need --rounds >= 1, --warmup >= 0, --image-size >= 64 (GoogLeNet) and --batch-size >= 2 '
            '(BatchNorm in training)'
        )
    return args


def print_row(row: dict) -> None:
    print(
        f'{row["model"]:<20} '
        + '  '.join(f'{v} {row["median_ms"][v]:7.1f} ms' for v in VARIANTS)
        + f'  repair vs CL {row["repair_vs_cl"]:.2f}x  breaks {row["layout_breaks"]}',
        flush=True,
    )


def measure_models(args: argparse.Namespace) -> list[dict]:
    """A row per model, and for a model that needs several rules, a row per rule alone."""
    rows = []
    for name in args.models:
        rows.append(measure(name, args))
        print_row(rows[-1])
        applied = rows[-1]['rules']
        if len(applied) > 1:
            for rule in applied:
                rows.append(measure(name, args, only_rule=rule))
                print_row(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    rows = measure_models(args)
    finish('repair', start, argv, args, rows, markdown)
    return 0


if __name__ == '__main__':
    sys.exit(main())
