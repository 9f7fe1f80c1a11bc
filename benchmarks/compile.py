"""Compile benchmark: training-step time with torch.compile and channels last, side by side.

Variants of each model, from the same weights, on the same random batch, interleaved round by
round in one process (channels_last_algo.core.timing):

    nchw              the model as built, NCHW input
    channels_last     model.to(memory_format=channels_last) and NHWC input (timm's --channels-last)
    ours              apply_channels_last(model) (repair and kernel safety on), NHWC input
    compiled_nchw     torch.compile(model) (inductor), NCHW input
    compiled_ours     apply_channels_last, then torch.compile, NHWC input
    compiled_guarded  LayoutGuard().on_init, then torch.compile, each step in guard.step(): where
                      this torch's inductor leaves backward graphs without layout optimisation,
                      it is forced on while the steps compile (core/compiled_backward.py)

A step is forward, a loss, backward and an SGD step (benchmarks/zoo.py's training_step).
Compilation happens in the warm-up rounds and is reported, not timed. A compile failure is a
row that says why (inductor build errors explained by core/inductor_errors.py). Where a compiled
variant compiles, the image-like buffers (C > 1, H*W > 1) of inductor's forward and backward code
whose channels are not innermost are counted (core/compiled_backward.py's channels_first_buffers).

    python benchmarks/compile.py                              # resnet50 and two zoo models
    python benchmarks/compile.py --models resnet50 --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import time
from typing import Optional

import torch
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from results_writer import RunStart, results_folder, run_record, write_results
from zoo import training_step
from zoo_models import build, by_name
from zoo_report import cell, measure_each, timed_row

from channels_last_algo.core.compiled_backward import channels_first_buffers
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.inductor_errors import explain_compile_failures
from channels_last_algo.core.machine_description import machine_label
from channels_last_algo.core.runtime import torch_release
from channels_last_algo.core.timing import time_interleaved

VARIANTS = ('nchw', 'channels_last', 'ours', 'compiled_nchw', 'compiled_ours', 'compiled_guarded')


def _steps(model_name: str, batch_size: int, size: int) -> dict:
    entry = by_name(model_name)
    torch.manual_seed(0)
    base = build(entry).train()
    images = torch.randn(batch_size, 3, size, size, generator=torch.Generator().manual_seed(1))
    nhwc = images.to(memory_format=torch.channels_last)
    steps = {}
    for name in VARIANTS:
        model = copy.deepcopy(base)
        if name in ('channels_last',):
            model = model.to(memory_format=torch.channels_last)
        if name in ('ours', 'compiled_ours'):
            apply_channels_last(model)
        guard = LayoutGuard() if name == 'compiled_guarded' else None
        if guard is not None:
            guard.on_init(model)
        if name.startswith('compiled'):
            model = torch.compile(model)
        step = training_step(model, images if name.endswith('nchw') else nhwc)
        steps[name] = _explained(step, guard) if name.startswith('compiled') else step
    return steps


def _explained(step, guard: Optional[LayoutGuard] = None):
    """``step`` with inductor's build failures explained, inside ``guard.step()`` where one is given."""

    def run() -> None:
        with explain_compile_failures(), guard.step() if guard is not None else contextlib.nullcontext():
            step()

    return run


def _buffers_not_nhwc(step) -> Optional[dict[str, int]]:
    """Run ``step`` once, where inductor compiles it, and count the image-like buffers of its
    forward and backward code whose channels are not innermost; None where it fails (the timing
    that follows records why)."""
    from torch._inductor.utils import run_and_get_code

    try:
        found = [len(channels_first_buffers(code)) for code in run_and_get_code(step)[1]]
    except Exception:  # any of dynamo's and inductor's errors
        return None
    return {'forward': found[0] if found else 0, 'backward': sum(found[1:])}


def measure(model_name: str, args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    steps = _steps(model_name, args.batch_size, args.image_size)
    warm = time.perf_counter()
    layouts = {name: _buffers_not_nhwc(step) for name, step in steps.items() if name.startswith('compiled')}
    warmup = time_interleaved(steps, rounds=1, warmup=1, catch=True)  # compiled already; not counted
    compile_seconds = time.perf_counter() - warm
    timings = time_interleaved(
        {k: v for k, v in steps.items() if k not in warmup.errors}, rounds=args.rounds, warmup=0, catch=True
    )
    row = timed_row(model_name, timings)
    row.update(build_seconds=warm - started, warmup_seconds=compile_seconds, buffers_not_nhwc=layouts)
    row['errors'] = warmup.errors | timings.errors
    return row


def markdown(result: dict) -> str:
    s, load = result['settings'], result['load_average_1min']
    lines = [
        '# Compile: training step time, eager and torch.compile, NCHW and channels last: '
        f'{machine_label(result["machine"])}',
        '',
        f'{result["machine"]["cpu"]}, torch {result["machine"]["torch"]}. {result["date"]}, '
        f'{result["seconds"] / 60:.0f} minutes. Command: `{result["command"]}`',
        '',
        f'Batch {s["batch_size"]} x {s["image_size"]} px, float32, {s["threads"]} torch threads, SGD with momentum; '
        f'{s["rounds"]} timed rounds after one warm-up round (where inductor compiles), variants interleaved. '
        f'1-minute load average {load["before"]:.1f} before, {load["after"]:.1f} after. '
        'Cells: median of per-round ratios over eager NCHW, its 95% interval, + / - beyond a 2% tie band.',
        '',
        '| model | NCHW ms (median) | ' + ' | '.join(VARIANTS[1:]) + ' | fastest | warm-up s | errors |',
        '|---|---:|' + '---:|' * (len(VARIANTS) - 1) + '---|---:|---|',
    ]
    for row in result['rows']:
        nchw = row['ms'].get('nchw', {}).get('median')
        cells = [cell(row['ratios'].get(name)) for name in VARIANTS[1:]]
        errors = '; '.join(f'{k}: {v}' for k, v in row['errors'].items())
        lines.append(f'| {row["model"]} | {nchw:.0f} | ' if nchw else f'| {row["model"]} | | ')
        lines[-1] += ' | '.join(cells) + f' | {row["fastest"]} | {row["warmup_seconds"]:.0f} | {errors} |'
    return '\n'.join(lines + _layout_table(result['rows'])) + '\n'


def _layout_table(rows: list[dict]) -> list[str]:
    """The compiled step's buffers whose channels are not innermost, forward / backward, per variant."""
    compiled = [name for name in VARIANTS if name.startswith('compiled')]
    lines = [
        '',
        "Image-like buffers (C > 1, H*W > 1) of inductor's compiled step whose channels are not innermost, "
        "forward / backward (compiled_nchw's forward counts its NCHW input and weights, which the code checks):",
        '',
        '| model | ' + ' | '.join(compiled) + ' |',
        '|---|' + '---:|' * len(compiled),
    ]
    for row in rows:
        counts = [row.get('buffers_not_nhwc', {}).get(name) for name in compiled]
        cells = [f'{c["forward"]} / {c["backward"]}' if c else '' for c in counts]
        lines.append(f'| {row["model"]} | ' + ' | '.join(cells) + ' |')
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(8),
        threads=Option(2),
        out='results folder (default: benchmarks/results/<machine>)',
        name=Option(f'compile-torch{torch_release()}'),
        epilog=False,
    )
    parser.add_argument('--models', nargs='+', default=['resnet50', 'mobilenet_v3_large', 'regnet_y_400mf'])
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--image-size', type=int, default=128)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    rows = measure_each(args.models, args.threads, lambda name: measure(name, args))
    settings = {k: getattr(args, k) for k in ('batch_size', 'image_size', 'rounds', 'threads')}
    result = run_record('compile', start, argv, settings=settings, rows=rows)
    text = markdown(result)
    write_results(results_folder(args.out, result['machine']), args.name, result, text)
    print(text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
