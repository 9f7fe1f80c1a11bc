"""Zoo benchmark: training-step time of every zoo model in NCHW, with Composer's ChannelsLast,
with this project, and in auto mode, interleaved in one process per model.

The models are :mod:`zoo_models`'s (torchvision's and timm's definitions,
random initialisation, nothing downloaded), each at its zoo input size. The variants start
from the same weights and train on the same random batch:

    nchw      the model as built, NCHW input
    composer  composer.algorithms.channels_last.apply_channels_last, as its Event.INIT does
              (model.to(memory_format=channels_last)), NCHW input; left out without Composer
    ours      apply_channels_last(model) (repair and kernel safety on), NHWC input, as the
              NHWC data path gives it
    auto      a copy converted as ``ours``, then decide_layout on the batch (bounded by
              --auto-seconds): the layout it keeps, with its input in that layout

A step is forward, a loss (the mean square of every output tensor: no labels, any head),
backward and an SGD step with momentum. After a warm-up round, --rounds rounds time one step
of every variant in a rotated order (channels_last_algo.core.timing). Speedups are medians of
per-round ratios with a 95% order-statistics interval; "beyond noise" means the interval lies
outside the tie band [1/1.02, 1.02], the same rule auto mode decides by. Each model runs in a
child process forked from a server that imported torch, timm, Composer and this package once
(so all models run the code as it was at the start): a crash (a kernel that corrupts the
heap) is recorded against the variant whose turn it was, and the model is run again without
it; a time-out is a row too. The report is :mod:`zoo_report`, next to this script.

    python benchmarks/zoo.py --quick          # a smoke run: 4 models, under a minute
    python benchmarks/zoo.py                  # the committed results: 55 models, 10 to 25 minutes on 2 busy cores
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from results_writer import RunStart, results_folder, run_record, write_results
from torch import nn
from torch.utils._pytree import tree_leaves
from zoo_models import TIMM_ZOO, TORCHVISION_ZOO, ZooEntry, build
from zoo_report import VARIANTS, cell, findings, geometric_means, markdown, summarise

from channels_last_algo.core.auto import decide_layout
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.timing import synchronizer, time_interleaved

QUICK_MODELS = ('resnet50', 'mobilenet_v3_large', 'repvgg_a0', 'ghostnet_050')
PRELOAD = (
    'torch',
    'torchvision',
    'timm',
    'composer.algorithms.channels_last',
    'zoo_models',
    'channels_last_algo.core.auto',
    'channels_last_algo.core.convert',
    'channels_last_algo.core.timing',
)


# --- one model, in a child process --------------------------------------------------------------------


def output_loss(output: Any) -> torch.Tensor:
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() for t in tensors)


def training_step(model: nn.Module, images: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step() -> None:
        output_loss(model(images)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _variants(
    entry: ZooEntry, names: tuple[str, ...], images: torch.Tensor, auto_seconds: float, turn: Callable[[str], Any]
) -> tuple[dict[str, Callable[[], None]], Optional[dict]]:
    """Each variant's training step, and auto mode's decision; ``turn(name)`` before each is built."""
    torch.manual_seed(0)
    base = build(entry).to(images.device).train()
    nhwc = images.to(memory_format=torch.channels_last)
    steps, decision = {}, None
    for name in names:
        turn(name)
        model = copy.deepcopy(base)
        if name == 'nchw':
            steps[name] = training_step(model, images)
        elif name == 'composer':
            from composer.algorithms.channels_last import apply_channels_last as composer_apply_channels_last

            composer_apply_channels_last(model)
            steps[name] = training_step(model, images)
        elif name == 'ours':
            apply_channels_last(model)
            steps[name] = training_step(model, nhwc)
        elif name == 'auto':
            apply_channels_last(model)
            chosen = decide_layout(
                model,
                lambda channels_last, model=model: output_loss(model(nhwc if channels_last else images)).backward(),
                max_seconds=auto_seconds,
            )
            decision = {
                'layout': str(chosen.layout),
                'tie': chosen.tie,
                'speedup': chosen.speedup,
                'interval': chosen.interval,
                'rounds': chosen.rounds,
                'stopped_by': chosen.stopped_by,
                'cost_seconds': chosen.cost_seconds,
            }
            steps[name] = training_step(model, nhwc if chosen.channels_last else images)
    return steps, decision


def run_model(entry: ZooEntry, names: tuple[str, ...], settings: dict, result_path: str, turn_path: str) -> None:
    """Child process: time ``names`` on ``entry`` and write the result as JSON to ``result_path``;
    ``turn_path`` always holds the name of the variant being built or run (for a crash's row)."""
    turn = Path(turn_path)
    torch.set_num_threads(settings['threads'])
    device = torch.device(settings['device'])
    channels, height, width = entry.input_shape[-3:]
    images = torch.randn(
        settings['batch_size'], channels, height, width, generator=torch.Generator().manual_seed(1)
    ).to(device)
    turn.write_text('build')
    steps, decision = _variants(entry, names, images, settings['auto_seconds'], turn.write_text)
    timings = time_interleaved(
        steps,
        rounds=settings['rounds'],
        warmup=settings['warmup'],
        prepare=turn.write_text,
        synchronize=synchronizer(device),
        catch=True,
    )
    Path(result_path).write_text(
        json.dumps(
            {
                'seconds': timings.seconds,
                'errors': timings.errors,
                'auto': decision,
                'load_average_1min': os.getloadavg()[0],
            }
        )
    )


def measure(entry: ZooEntry, names: tuple[str, ...], settings: dict, context: Any) -> dict:
    """One model's row: its variants run in a child process, again without a variant that crashed."""
    row: dict[str, Any] = {
        'model': entry.name,
        'family': entry.family,
        'source': entry.source,
        'input_shape': list(entry.input_shape),
        'seconds': {},
        'errors': {},
        'auto': None,
    }
    left = list(names)
    with tempfile.TemporaryDirectory(prefix='zoo-bench-') as tmp:
        result_path, turn_path = Path(tmp) / 'result.json', Path(tmp) / 'turn'
        while left:
            child = context.Process(
                target=run_model, args=(entry, tuple(left), settings, str(result_path), str(turn_path))
            )
            child.start()
            child.join(settings['timeout'])
            if child.is_alive():
                child.kill()
                child.join()
                row['errors']['all'] = f'timed out after {settings["timeout"]} s'
                break
            if result_path.exists():
                result = json.loads(result_path.read_text())
                row['errors'].update(result.pop('errors'))
                row.update(result)
                break
            culprit = turn_path.read_text() if turn_path.exists() else 'build'
            reason = f'process died (exit code {child.exitcode}) during {culprit}'
            if culprit not in left:  # before any variant ran: nothing to leave out
                row['errors']['all'] = reason
                break
            row['errors'][culprit] = reason
            left.remove(culprit)
    return summarise(row)


# --- the run --------------------------------------------------------------------------------------------


def select(args: argparse.Namespace) -> list[ZooEntry]:
    """The zoo entries to run: those named (from either zoo), the quick set, or all."""
    entries = list(TORCHVISION_ZOO) + list(TIMM_ZOO)
    names = args.models or (QUICK_MODELS if args.quick else None)
    if names is None:
        return entries
    unknown = sorted(set(names) - {entry.name for entry in entries})
    if unknown:
        raise SystemExit(f'not in the zoo: {", ".join(unknown)}; choose from {", ".join(e.name for e in entries)}')
    return [entry for entry in entries if entry.name in names]


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(9, 'timed rounds (6 or more give a 95%% interval)'),
        warmup=Option(1, 'untimed rounds first'),
        threads=Option(
            1,
            'torch threads (default 1: on a 2-core machine shared with other work, 2 threads made a ResNet-50 '
            'step 3 to 15 times slower than 1, waiting on each other)',
        ),
        out='results folder (default: benchmarks/results/<machine>)',
        name=Option('zoo', 'file name stem of the results (default: zoo)'),
    )
    parser.add_argument('--models', nargs='+', help='zoo model names (default: the whole zoo)')
    parser.add_argument('--batch-size', type=int, default=4)
    parser.add_argument('--auto-seconds', type=float, default=10.0, help="bound on auto mode's decision, per model")
    parser.add_argument('--timeout', type=float, default=240.0, help='seconds per model before its child is ended')
    parser.add_argument(
        '--quick', action='store_true', help=f'a smoke run: {", ".join(QUICK_MODELS)}; 6 rounds, batch 4, 5 s decisions'
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch_size, args.auto_seconds = 6, 4, 5.0
    if args.rounds < 1 or args.warmup < 0 or args.batch_size < 2:
        parser.error('need --rounds >= 1, --warmup >= 0 and --batch-size >= 2 (BatchNorm in training)')
    return args


def child_processes(threads: int) -> Any:
    """A forkserver context whose server imported torch, timm, Composer and this package once: every
    child forks from it, so all models run the code as it was when the run started."""
    torch.set_num_threads(threads)  # the machine record says how many the children use
    context = multiprocessing.get_context('forkserver')
    context.set_forkserver_preload(list(PRELOAD))
    return context


def run_models(entries: list[ZooEntry], names: tuple[str, ...], settings: dict, start: RunStart) -> tuple[list, list]:
    """Each model's row, printed as it comes, and the load average each model's child saw."""
    context = child_processes(settings['threads'])
    loads, rows = [start.load_before], []
    for index, entry in enumerate(entries):
        row = measure(entry, names, settings, context)
        rows.append(row)
        loads.append(row.get('load_average_1min', loads[-1]))
        speedups = '  '.join(f'{key} {cell(value)}' for key, value in row['ratios'].items())
        print(
            f'[{time.perf_counter() - start.clock:5.0f} s] {index + 1}/{len(entries)} {entry.name}: {speedups} '
            f'{"auto " + row["auto"]["layout"] if row["auto"] else ""} {row["errors"] or ""}',
            flush=True,
        )
    return rows, loads[1:] or loads


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    entries = select(args)
    composer = importlib.util.find_spec('composer') is not None
    names = tuple(name for name in VARIANTS if composer or name != 'composer')
    device = 'cuda' if torch.cuda.is_available() else 'cpu'
    settings = {
        'batch_size': args.batch_size,
        'rounds': args.rounds,
        'warmup': args.warmup,
        'auto_seconds': args.auto_seconds,
        'timeout': args.timeout,
        'threads': args.threads,
        'device': device,
    }
    rows, loads = run_models(entries, names, settings, start)
    import timm

    composer_version = importlib.import_module('composer').__version__ if composer else None
    versions = {'timm': timm.__version__, 'composer': composer_version}
    result = run_record('zoo', start, argv, load_during=loads, **versions, settings=settings, variants=list(names))
    result.update(rows=rows, geometric_means=geometric_means(rows, names), findings=findings(rows))
    out = results_folder(args.out, result['machine'])
    text = markdown(result)
    write_results(out, args.name, result, text)
    print(text)
    print(f'wrote {out / args.name}.json and .md')
    return 0


if __name__ == '__main__':
    sys.exit(main())
