"""Loader throughput on ImageNet-like JPEGs: the NHWC data path against torchvision's
ImageFolder pipeline, the previous NHWC loader and (when installed) NVIDIA DALI's CPU pipeline.

Every pipeline reads the same generated JPEGs (``imagenet_jpegs.py``: ImageNet's sizes and
file sizes) and applies the ImageNet recipe's geometry (train: RandomResizedCrop + flip; val:
Resize + CenterCrop), then:

    torchvision   ImageFolder (Pillow decode) -> Pillow crop/resize -> ToTensor + Normalize
                  -> default_collate -> NCHW float32 to the device
    nhwc-pil      the previous NHWC loader: the same Pillow geometry -> ToHWCUint8 ->
                  collate_nhwc -> NHWC uint8 to the device -> NormalizeBatch
    nhwc          CheckedImageFolder with the NHWC crops: header-planned crop, scaled decode,
                  uint8 NHWC resize into the batch slot -> NHWC uint8 -> NormalizeBatch
    dali          DALI's CPU pipeline (loader_dali.py), NHWC uint8, as many threads as workers
                  (at least one); only when ``nvidia-dali-cuda120`` is installed

Each pass reads the whole set once and moves every batch to --device. The NHWC pipelines end
there, as uint8 NHWC batches: their normalisation belongs to the device (``NormalizeBatch``, a
few microseconds a batch on a GPU); on a CUDA device it is included. On the CPU the row
``nhwc+normalize`` adds it, so the cost of doing it on the CPU is in the table too. Passes are
interleaved across pipelines round by round, after one warm-up pass each; the table gives
images/s of the fastest and the median pass, and the paired per-round ratio to torchvision.

Example:
    flock /tmp/channels_last_timing.lock .venv/bin/python benchmarks/loader.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Optional

import numpy as np
import PIL
import PIL.features
import torch
import torchvision
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from imagenet_jpegs import write_imagenet_like_folder
from loader_dali import dali_available, dali_pass
from results_writer import RunStart, run_record, write_results
from torch.utils.data import DataLoader
from torchvision import transforms

from channels_last_algo.app.data.image_folder import CheckedImageFolder
from channels_last_algo.app.data.loaders import IMAGENET_MEAN, IMAGENET_STD, NormalizeBatch, build_loader
from channels_last_algo.app.data.transforms import ToHWCUint8, eval_transform, train_transform
from channels_last_algo.core.timing import synchronizer, time_interleaved


def torchvision_geometry(split: str, args: argparse.Namespace) -> list:
    """The ImageNet recipe's PIL transforms, as torchvision's reference scripts write them."""
    if split == 'train':
        return [transforms.RandomResizedCrop(args.crop), transforms.RandomHorizontalFlip()]
    return [transforms.Resize(args.resize), transforms.CenterCrop(args.crop)]


def pipeline_loaders(folder: Path, split: str, args: argparse.Namespace, pin: bool) -> dict[str, DataLoader]:
    """torchvision's ImageFolder loader (float32 NCHW, normalised), the previous NHWC loader (Pillow
    geometry) and the NHWC data path's loader, over ``folder``."""
    geometry = torchvision_geometry(split, args)
    float_loader = DataLoader(
        torchvision.datasets.ImageFolder(
            str(folder),
            transforms.Compose([*geometry, transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]),
        ),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=pin,
        persistent_workers=args.workers > 0,
    )
    crop = train_transform(args.crop) if split == 'train' else eval_transform(args.crop, args.resize)
    nhwc_sets = {
        'nhwc-pil': CheckedImageFolder(folder, transforms.Compose([*geometry, ToHWCUint8()])),
        'nhwc': CheckedImageFolder(folder, crop),
    }
    return {
        'torchvision': float_loader,
        **{
            name: build_loader(data, batch_size=args.batch_size, train=False, workers=args.workers, pin_memory=pin)
            for name, data in nhwc_sets.items()
        },
    }


def device_pass(batches: Iterable, device: torch.device, normalize: Optional[NormalizeBatch]) -> Iterator:
    """One pass over ``batches``, each moved to ``device`` (and normalised there, with ``normalize``)."""
    for images, labels in batches:
        batch = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        yield normalize(batch) if normalize is not None else batch


def make_passes(folder: Path, split: str, args: argparse.Namespace) -> dict[str, Callable[[], Iterable]]:
    """For each pipeline, a function that runs one pass and yields device batches."""
    device = torch.device(args.device)
    on_gpu = device.type == 'cuda'
    loaders = pipeline_loaders(folder, split, args, pin=on_gpu)
    normalize = NormalizeBatch()
    on_device = normalize if on_gpu else None  # the NHWC batches' normalisation belongs to a GPU
    passes = {
        name: functools.partial(device_pass, loader, device, None if name == 'torchvision' else on_device)
        for name, loader in loaders.items()
    }
    if not on_gpu:
        passes['nhwc+normalize'] = functools.partial(device_pass, loaders['nhwc'], device, normalize)
    if args.dali and dali_available():
        dali = dali_pass(
            folder,
            split,
            batch_size=args.batch_size,
            crop=args.crop,
            resize=args.resize,
            threads=max(1, args.workers),
            seed=args.seed,
        )
        passes['dali'] = lambda: device_pass(dali(), device, on_device)
    return passes


def measure(folder: Path, split: str, args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    passes = make_passes(folder, split, args)
    counts = {}

    def one_pass(name: str) -> None:
        counts[name] = sum(images.shape[0] for images, _ in passes[name]())

    # one warm-up pass each: worker start, page cache, first allocations
    timings = time_interleaved(
        {name: functools.partial(one_pass, name) for name in passes},
        rounds=args.repeats,
        warmup=1,
        synchronize=synchronizer(device),
    )
    pixels = args.batch_size * 3 * args.crop**2
    rows = []
    for name in passes:
        seconds = timings.seconds[name]
        ratio = timings.ratio('torchvision', name)
        rows.append(
            {
                'split': split,
                'workers': args.workers,
                'pipeline': name,
                'images': counts[name],
                'seconds': seconds,
                'best_images_per_s': counts[name] / min(seconds),
                'median_images_per_s': counts[name] / statistics.median(seconds),
                'speedup_vs_torchvision': ratio.median,
                'speedup_interval': ratio.interval,
                'batch_bytes_to_device': pixels * (4 if name == 'torchvision' else 1),  # float32 or uint8
            }
        )
    passes.clear()
    gc.collect()  # ends the persistent workers before the next group starts its own
    return rows


def markdown(result: dict) -> str:
    m, s, d = result['machine'], result['settings'], result['data']
    lines = [
        '# Loader throughput on ImageNet-like JPEGs: NHWC data path vs torchvision ImageFolder',
        '',
        f'Machine: {m["cpu"]}, {m["cores_usable"]} usable cores ({m["cores"]} online), '
        f'{m["torch_threads"]} torch thread(s) in the main process, 1 per worker, '
        f'GPU: {m["gpu"] or "none"}; device `{s["device"]}`.',
        f'torch {m["torch"]}, torchvision {m["torchvision"]}, Pillow {m["pillow"]} (libjpeg-turbo '
        f'{m["libjpeg_turbo"]}), DALI {m["dali"] or "not installed"}, numpy {m["numpy"]}, Python {m["python"]}.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after the run (other work on the machine makes passes vary).',
        '',
        f'{d["images"]} generated JPEGs in {d["classes"]} classes (quality {d["quality"]}, mean '
        f'{d["mean_width"]:.0f} x {d["mean_height"]:.0f} px, mean {d["mean_kib"]:.0f} KiB), batch '
        f'{s["batch_size"]}, crop {s["crop"]} (val resize {s["resize"]}), {s["repeats"]} timed passes per '
        'pipeline after one warm-up, interleaved. Images/s from the fastest and the median pass; '
        '"vs torchvision" is the median over rounds of the torchvision pass time over this pipeline\'s '
        'pass time in the same round (above 1: faster), with its 95% interval; "to device" is one '
        'batch as it leaves the loader.',
        '',
        '| split | workers | pipeline | best img/s | median img/s | vs torchvision | 95% interval | to device |',
        '|---|---:|---|---:|---:|---:|---|---:|',
        *table_rows(result['rows']),
        *best_section(result['rows']),
    ]
    return '\n'.join(lines) + '\n'


def best_section(rows: list[dict]) -> list[str]:
    """Each pipeline at its best worker count against torchvision at its best, and DALI against this path."""
    lines = [
        '',
        'Each pipeline at its best worker count on these cores (highest median images/s over the '
        'worker counts above), against torchvision at its best:',
        '',
        '| split | pipeline | workers | median img/s | vs torchvision at its best |',
        '|---|---|---:|---:|---:|',
    ]
    best = best_configurations(rows)
    for (split, pipeline), row in best.items():
        ratio = row['median_images_per_s'] / best[split, 'torchvision']['median_images_per_s']
        lines.append(f'| {split} | {pipeline} | {row["workers"]} | {row["median_images_per_s"]:.0f} | {ratio:.2f}x |')
    dali = [
        f'{split} {best[split, "dali"]["median_images_per_s"] / best[split, "nhwc"]["median_images_per_s"]:.2f}x'
        for split in dict.fromkeys(split for split, _ in best)
        if (split, 'dali') in best
    ]
    if dali:
        lines += [
            '',
            f'DALI at its best against this path (nhwc) at its best: {", ".join(dali)} (above 1: DALI is faster).',
        ]
    return lines


def best_configurations(rows: list[dict]) -> dict[tuple[str, str], dict]:
    """``{(split, pipeline): its row at the worker count with the highest median images/s}``."""
    best = {}
    for row in rows:
        key = (row['split'], row['pipeline'])
        if key not in best or row['median_images_per_s'] > best[key]['median_images_per_s']:
            best[key] = row
    return best


def table_rows(rows: list[dict]) -> list[str]:
    """One markdown row per measured group and pipeline."""
    lines = []
    for row in rows:
        interval = row['speedup_interval']
        shown = f'{interval[0]:.2f}-{interval[1]:.2f}' if interval else 'n/a'
        lines.append(
            f'| {row["split"]} | {row["workers"]} | {row["pipeline"]} | '
            f'{row["best_images_per_s"]:.0f} | {row["median_images_per_s"]:.0f} | '
            f'{row["speedup_vs_torchvision"]:.2f}x | {shown} | {row["batch_bytes_to_device"] / 2**20:.1f} MiB |'
        )
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(7, 'timed passes per pipeline', flag='--repeats'),
        threads=Option(
            1,
            'torch threads of the main process (workers always use 1); per-image ops on a '
            'busy machine slow down badly with more than one',
        ),
        out='folder for NAME.json and NAME.md (else print only)',
        name=Option('loader', 'file name of the results, without extension'),
    )
    parser.add_argument('--images', type=int, default=256, help='JPEGs generated (one pass reads them all)')
    parser.add_argument('--classes', type=int, default=8, help='class folders')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--crop', type=int, default=224, help='train and val crop size')
    parser.add_argument('--resize', type=int, default=232, help='val resize of the short side')
    parser.add_argument('--workers', type=int, nargs='+', default=[0, 1, 2], help='DataLoader workers to try')
    parser.add_argument('--splits', nargs='+', choices=('train', 'val'), default=['train', 'val'])
    parser.add_argument('--no-dali', dest='dali', action='store_false', help='leave DALI out even when installed')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def measure_groups(folder: Path, args: argparse.Namespace) -> list[dict]:
    """The rows of every split and worker count, printed as each group ends."""
    rows = []
    for split in args.splits:
        for workers in args.workers:
            group_rows = measure(folder, split, argparse.Namespace(**{**vars(args), 'workers': workers}))
            rows += group_rows
            for row in group_rows:
                print(
                    f'{split:5} workers={workers} {row["pipeline"]:12} '
                    f'best {row["best_images_per_s"]:6.0f} img/s  median {row["median_images_per_s"]:6.0f}'
                    f'  ({row["speedup_vs_torchvision"]:.2f}x)',
                    flush=True,
                )
    return rows


def library_versions(dali: bool) -> dict:
    """Pillow, libjpeg-turbo, numpy and DALI (None where DALI is left out or not installed)."""
    dali_version = None
    if dali and dali_available():
        from nvidia import dali as dali_module

        dali_version = dali_module.__version__
    return {
        'pillow': PIL.__version__,
        'libjpeg_turbo': PIL.features.version('libjpeg_turbo'),
        'numpy': np.__version__,
        'dali': dali_version,
    }


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix='loader-bench-') as tmp:
        data = write_imagenet_like_folder(Path(tmp), args.images, args.classes, args.seed)
        rows = measure_groups(Path(tmp), args)
    keys = ('batch_size', 'crop', 'resize', 'repeats', 'device', 'seed')
    settings = {key: getattr(args, key) for key in keys}
    result = run_record('loader', start, argv, library_versions(args.dali), settings=settings, data=data, rows=rows)
    if args.out is not None:
        for path in write_results(args.out, args.name, result, markdown(result)):
            print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
