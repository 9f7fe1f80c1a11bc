"""DDP training step time on CPU ranks (gloo): NCHW against channels last, 1 rank against 2.

For each world size (default 1 and 2) the script starts that many ranks with Composer's
launcher (``python -m composer.cli.launcher -n W``, which sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, ...), each rank with ``--threads-per-rank`` torch threads (default 1: one core per
rank, as one GPU per rank). Each rank builds the small ResNet-like net of the demo
(:class:`channels_last_algo.app.runs.demo.TinyResNet`: conv-BN-ReLU stem, max pooling, two residual
blocks, global pooling, a linear head) from the same weights three times and wraps each copy in
``DistributedDataParallel``:

    nchw                  as built; NCHW batches
    channels_last         LayoutGuard.on_init before DDP is built (what ChannelsLast does at
                          Event.INIT, before Composer wraps the model); NHWC batches
    restrided_after_wrap  the same conversion after DDP is built: its gradient buckets keep the
                          NCHW strides, so every step each gradient is copied across layouts
                          into its bucket and back (and DDP warns once)

The global batch is fixed (strong scaling): each rank trains on global/W images a step. A step
is zero_grad, forward, cross-entropy, backward (DDP's allreduce included) and an SGD step. After
warm-up, rounds interleave the variants; each round times ``--steps`` steps of each between
barriers on every rank (rank 0's clock), so a noisy machine slows all variants alike. Reported:
min and median ms per step over the rounds, images/s from the median, the speedup over NCHW in
the same world size (median of per-round ratios), the scaling from 1 rank to W ranks, and
whether DDP warned "Grad strides do not match bucket view strides".

Example:
    flock /tmp/channels_last_timing.lock .venv/bin/python benchmarks/ddp.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from results_writer import RunStart, run_record, write_results
from torch import nn

from channels_last_algo.app.runs.demo import TinyResNet
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.machine_description import machine_label
from channels_last_algo.core.timing import Ratio, time_interleaved

VARIANTS = ('nchw', 'channels_last', 'restrided_after_wrap')
STRIDE_WARNING = 'Grad strides do not match bucket view strides'
SETTINGS = ('global_batch', 'image_size', 'width', 'steps', 'rounds', 'warmup', 'threads_per_rank', 'seed')
"""The settings a run records and hands on to each rank's command line."""


# --- one rank -----------------------------------------------------------------------------------------


def build_variant(name: str, base: nn.Module) -> nn.Module:
    """A DDP-wrapped copy of ``base`` set up as variant ``name`` describes."""
    model = copy.deepcopy(base)
    if name == 'channels_last':
        LayoutGuard().on_init(model)
    wrapped = nn.parallel.DistributedDataParallel(model)
    if name == 'restrided_after_wrap':
        apply_channels_last(model)
    return wrapped


def rank_batch(args: argparse.Namespace, world: int, rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's share of the global batch: its images in each variant's layout, and its labels."""
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    per_rank = args.global_batch // world
    images = torch.randn(per_rank, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, 10, (per_rank,), generator=generator)
    batches = {
        'nchw': images,
        'channels_last': to_channels_last(images),
        'restrided_after_wrap': to_channels_last(images),
    }
    return batches, labels


def training_steps(base: nn.Module, batches: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, Callable]:
    """Each variant's training step: zero_grad, forward, cross-entropy, backward (with DDP's allreduce), SGD."""
    models = {name: build_variant(name, base) for name in VARIANTS}
    optimizers = {name: torch.optim.SGD(models[name].parameters(), lr=0.01, momentum=0.9) for name in VARIANTS}

    def step(name: str) -> None:
        optimizers[name].zero_grad(set_to_none=True)
        nn.functional.cross_entropy(models[name](batches[name]), labels).backward()
        optimizers[name].step()

    return {name: functools.partial(step, name) for name in VARIANTS}


def warm_up(steps: dict[str, Callable], count: int) -> dict[str, bool]:
    """``count`` untimed steps of each variant, in order; whether DDP warned about strides in each
    (the warning fires once per process, so the order matters)."""
    warned = {}
    for name, step in steps.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for _ in range(count):
                step()
        warned[name] = any(STRIDE_WARNING in str(w.message) for w in caught)
    return warned


def rank_program(args: argparse.Namespace) -> None:
    """Time every variant on this rank; rank 0 writes ``args.rank_out``."""
    world = int(os.environ['WORLD_SIZE'])
    rank = int(os.environ['RANK'])
    torch.set_num_threads(args.threads_per_rank)
    dist.init_process_group('gloo')
    torch.manual_seed(args.seed)
    base = TinyResNet(num_classes=10, width=args.width)
    batches, labels = rank_batch(args, world, rank)
    steps = training_steps(base, batches, labels)
    warned = warm_up(steps, args.warmup)
    # every rank runs the same rounds in the same order; the clock is read between barriers
    timings = time_interleaved(steps, rounds=args.rounds, warmup=0, repeat=args.steps, synchronize=dist.barrier)
    if rank == 0:
        measured = {
            'seconds_per_step': timings.seconds,
            'stride_warning': warned,
            'threads_per_rank': torch.get_num_threads(),
            'images_per_rank': len(labels),
        }
        Path(args.rank_out).write_text(json.dumps(measured))
    dist.destroy_process_group()


# --- the driver ---------------------------------------------------------------------------------------


def launcher_command(world: int, args: argparse.Namespace, folder: Path, out: Path) -> list[str]:
    """Composer's launcher starting ``world`` ranks of this script, each writing its log to ``folder``."""
    options = [text for key in SETTINGS for text in (f'--{key.replace("_", "-")}', str(getattr(args, key)))]
    return [
        sys.executable,
        '-m',
        'composer.cli.launcher',
        '-n',
        str(world),
        '--stdout',
        str(folder / f'world{world}-rank{{rank}}.log'),
        str(Path(__file__).resolve()),
        '--rank-out',
        str(out),
        *options,
    ]


def launch(world: int, args: argparse.Namespace, folder: Path) -> dict:
    """Run the rank program on ``world`` ranks with Composer's launcher; rank 0's measurements."""
    out = folder / f'world{world}.json'
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT')
    }
    env['OMP_NUM_THREADS'] = str(args.threads_per_rank)
    process = subprocess.run(launcher_command(world, args, folder, out), env=env, capture_output=True, text=True)
    if process.returncode != 0 or not out.exists():
        logs = '\n'.join(p.read_text()[-2000:] for p in sorted(folder.glob(f'world{world}-rank*.log')))
        raise RuntimeError(f'{world} ranks failed (exit {process.returncode}):\n{process.stderr[-4000:]}\n{logs}')
    return json.loads(out.read_text())


def summarise(measured: dict[int, dict], global_batch: int) -> list[dict]:
    rows = []
    for world, result in measured.items():
        seconds = result['seconds_per_step']
        for name in VARIANTS:
            median = statistics.median(seconds[name])
            ratio = Ratio.of([base / own for base, own in zip(seconds['nchw'], seconds[name])])
            rows.append(
                {
                    'world_size': world,
                    'threads_per_rank': result['threads_per_rank'],
                    'images_per_rank': result['images_per_rank'],
                    'variant': name,
                    'seconds_per_step': seconds[name],
                    'min_ms': 1000 * min(seconds[name]),
                    'median_ms': 1000 * median,
                    'images_per_s': global_batch / median,
                    'speedup_vs_nchw': ratio.median,
                    'noise_vs_nchw': ratio.noise,
                    'stride_warning': result['stride_warning'][name],
                }
            )
    single = {row['variant']: row['images_per_s'] for row in rows if row['world_size'] == min(measured)}
    for row in rows:
        row['scaling_vs_1_rank'] = row['images_per_s'] / single[row['variant']]
    return rows


def table_row(row: dict) -> str:
    return (
        f'| {row["world_size"]} | {row["variant"]} | {row["min_ms"]:.1f} | {row["median_ms"]:.1f} | '
        f'{row["images_per_s"]:.0f} | {row["speedup_vs_nchw"]:.2f}x | {row["scaling_vs_1_rank"]:.2f}x | '
        f'{"yes" if row["stride_warning"] else "no"} |'
    )


def markdown(result: dict) -> str:
    s = result['settings']
    worlds = sorted({row['world_size'] for row in result['rows']})
    lines = [
        f'# DDP step time on CPU ranks (gloo): {machine_label(result["machine"])}',
        '',
        f'{result["machine"]["cpu"]}, {result["machine"]["cores_usable"]} usable cores, GPU: '
        f'{result["machine"]["gpu"] or "none"}; torch {result["machine"]["torch"]}, oneDNN '
        f'{result["machine"]["onednn"]}, Python {result["machine"]["python"]}. {result["date"]}.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after the run (other work on the machine makes rounds vary).',
        '',
        f'TinyResNet (width {s["width"]}) on {s["image_size"]}x{s["image_size"]} images, global batch '
        f"{s['global_batch']} split over the ranks, SGD with momentum; ranks started by Composer's launcher, "
        f'{s["threads_per_rank"]} torch thread(s) per rank. {s["rounds"]} rounds of '
        f'{s["steps"]} steps per variant after {s["warmup"]} warm-up steps, interleaved. ms per step: min and '
        'median over the rounds; images/s from the median; "vs NCHW": median of the per-round ratios at the '
        'same world size (above 1: faster); "vs 1 rank": images/s over the same variant\'s on 1 rank; '
        '"warns": DDP printed "Grad strides do not match bucket view strides".',
        '',
        '| ranks | variant | min ms | median ms | images/s | vs NCHW | vs 1 rank | warns |',
        '|---:|---|---:|---:|---:|---:|---:|---|',
        *map(table_row, result['rows']),
    ]
    if len(worlds) > 1:
        lines += [
            '',
            f'All ranks run on this one machine, {s["threads_per_rank"]} thread(s) each: "vs 1 rank" is the '
            "strong scaling of a fixed global batch from one core to one core per rank, with gloo's "
            'allreduce over loopback, not multi-machine scaling. Other work on the machine (the load '
            'average above) takes cores from the ranks: with a load near the core count, 2 ranks get '
            'little more than one core between them.',
        ]
    return '\n'.join(lines) + '\n'


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(7),
        warmup=Option(3, 'untimed steps per variant first'),
        threads=Option(
            1,
            'torch threads of each rank (default 1: one core per rank; more threads than free '
            'cores make oneDNN steps many times slower on a busy machine)',
            flag='--threads-per-rank',
        ),
        out='folder for ddp.json and ddp.md (else print only)',
    )
    parser.add_argument('--worlds', type=int, nargs='+', default=[1, 2], help='world sizes to run (ranks)')
    parser.add_argument('--global-batch', type=int, default=32, help='images per step over all ranks')
    parser.add_argument('--image-size', type=int, default=64)
    parser.add_argument('--width', type=int, default=32, help='TinyResNet channels')
    parser.add_argument('--steps', type=int, default=5, help='timed steps per variant and round')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--rank-out', help=argparse.SUPPRESS)  # set by the driver for the rank program
    args = parser.parse_args(argv)
    for world in args.worlds:
        if world < 1 or args.global_batch % world:
            parser.error(f'--global-batch {args.global_batch} must split evenly over {world} ranks')
    return args


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    if args.rank_out is not None:
        rank_program(args)
        return 0
    with tempfile.TemporaryDirectory(prefix='ddp-bench-') as tmp:
        measured = {world: launch(world, args, Path(tmp)) for world in sorted(args.worlds)}
    rows = summarise(measured, args.global_batch)
    settings = {key: getattr(args, key) for key in SETTINGS}
    result = run_record('ddp', start, argv, {'torch_threads': args.threads_per_rank}, settings=settings, rows=rows)
    text = markdown(result)
    print(text)
    if args.out is not None:
        write_results(args.out, 'ddp', result, text)
        print(f'wrote {args.out / "ddp.json"} and {args.out / "ddp.md"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
