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
import os
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import PIL
import PIL.features
import torch
import torchvision
from imagenet_jpegs import write_imagenet_like_folder
from loader_dali import dali_available, dali_pass
from torch.utils.data import DataLoader
from torchvision import transforms

from channels_last_algo.app.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CheckedImageFolder,
    NormalizeBatch,
    ToHWCUint8,
    build_loader,
    eval_transform,
    train_transform,
)
from channels_last_algo.core.machine import run_record, write_results
from channels_last_algo.core.timing import synchronizer, time_interleaved


def torchvision_geometry(split: str, args: argparse.Namespace) -> list:
    """The ImageNet recipe's PIL transforms, as torchvision's reference scripts write them."""
    if split == 'train':
        return [transforms.RandomResizedCrop(args.crop), transforms.RandomHorizontalFlip()]
    return [transforms.Resize(args.resize), transforms.CenterCrop(args.crop)]


def make_passes(folder: Path, split: str, args: argparse.Namespace) -> dict[str, Callable[[], Iterable]]:
    """For each pipeline, a function that runs one pass and yields device batches."""
    device = torch.device(args.device)
    pin = device.type == 'cuda'
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
    nhwc_loaders = {
        'nhwc-pil': CheckedImageFolder(folder, transforms.Compose([*geometry, ToHWCUint8()])),
        'nhwc': CheckedImageFolder(folder, crop),
    }
    nhwc_loaders = {
        name: build_loader(data, batch_size=args.batch_size, train=False, workers=args.workers, pin_memory=pin)
        for name, data in nhwc_loaders.items()
    }
    normalize = NormalizeBatch()

    def torchvision_pass():
        for images, labels in float_loader:
            yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    def nhwc_pass(loader, normalized: bool):
        for images, labels in loader:
            batch = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            yield normalize(batch) if normalized else batch

    on_gpu = device.type == 'cuda'
    passes = {
        'torchvision': torchvision_pass,
        **{name: functools.partial(nhwc_pass, loader, on_gpu) for name, loader in nhwc_loaders.items()},
    }
    if not on_gpu:
        passes['nhwc+normalize'] = functools.partial(nhwc_pass, nhwc_loaders['nhwc'], True)
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
        passes['dali'] = lambda: nhwc_pass(dali(), on_gpu)
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
        '',
        'Each pipeline at its best worker count on these cores (highest median images/s over the '
        'worker counts above), against torchvision at its best:',
        '',
        '| split | pipeline | workers | median img/s | vs torchvision at its best |',
        '|---|---|---:|---:|---:|',
    ]
    best = best_configurations(result['rows'])
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
    return '\n'.join(lines) + '\n'


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
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split('\n\n', 1)[1],
    )
    parser.add_argument('--images', type=int, default=256, help='JPEGs generated (one pass reads them all)')
    parser.add_argument('--classes', type=int, default=8, help='class folders')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--crop', type=int, default=224, help='train and val crop size')
    parser.add_argument('--resize', type=int, default=232, help='val resize of the short side')
    parser.add_argument('--workers', type=int, nargs='+', default=[0, 1, 2], help='DataLoader workers to try')
    parser.add_argument('--splits', nargs='+', choices=('train', 'val'), default=['train', 'val'])
    parser.add_argument('--repeats', type=int, default=7, help='timed passes per pipeline')
    parser.add_argument('--no-dali', dest='dali', action='store_false', help='leave DALI out even when installed')
    parser.add_argument(
        '--threads',
        type=int,
        default=1,
        help='torch threads of the main process (workers always use 1); per-image ops on a '
        'busy machine slow down badly with more than one',
    )
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', type=Path, help='folder for NAME.json and NAME.md (else print only)')
    parser.add_argument('--name', default='loader', help='file name of the results, without extension')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix='loader-bench-') as tmp:
        folder = Path(tmp)
        data = write_imagenet_like_folder(folder, args.images, args.classes, args.seed)
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
    dali_version = None
    if args.dali and dali_available():
        from nvidia import dali

        dali_version = dali.__version__
    machine = {
        'pillow': PIL.__version__,
        'libjpeg_turbo': PIL.features.version('libjpeg_turbo'),
        'numpy': np.__version__,
        'dali': dali_version,
    }
    settings = {
        'batch_size': args.batch_size,
        'crop': args.crop,
        'resize': args.resize,
        'repeats': args.repeats,
        'device': args.device,
        'seed': args.seed,
    }
    result = run_record(argv, load_before, machine, settings=settings, data=data, rows=rows)
    if args.out is not None:
        for path in write_results(args.out, args.name, result, markdown(result)):
            print(f'wrote {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
