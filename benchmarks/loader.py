"""Loader throughput: the NHWC uint8 data path against torchvision's ToTensor + Normalize.

Both pipelines read the same images and run the same geometric transforms on PIL images
(train: RandomResizedCrop + flip; val: Resize + CenterCrop); they differ from there on:

    torchvision        ToTensor + Normalize per image -> default_collate -> NCHW float32
    torchvision+nhwc   the same, then .to(memory_format=channels_last), as a channels-last
                       model needs it (what Composer's ChannelsLast does to each batch)
    nhwc               ToHWCUint8 per image -> collate_nhwc -> NHWC uint8 -> NormalizeBatch
                       -> NHWC float32 (on --device, after the transfer)

Each pass reads the whole set once and moves every batch to --device. Passes are interleaved
across pipelines, after one warm-up pass each; the table gives images/s of the fastest and
the median pass, and the bytes of one batch as it crosses to the device. The data: a folder
of JPEGs written to a temporary directory, and the embedded synthetic set (no decoding).

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
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import PIL
import torch
from torch.utils.data import DataLoader
from torchvision import transforms

from channels_last_algo.app.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CheckedImageFolder,
    NormalizeBatch,
    SyntheticImageNet,
    build_loader,
    eval_transform,
    train_transform,
)
from channels_last_algo.core.machine import describe_machine, write_results
from channels_last_algo.core.timing import synchronizer, time_interleaved

PIPELINES = ('torchvision', 'torchvision+nhwc', 'nhwc')


def write_jpeg_folder(root: Path, images: int, classes: int, seed: int) -> Path:
    """``images`` JPEGs (quality 90) of 224 to 320 pixels a side under ``root/<class>/``."""
    rng = np.random.default_rng(seed)
    source = SyntheticImageNet(images, num_classes=classes, image_size=320, seed=seed)
    for index in range(images):
        height, width = rng.integers(224, 321, size=2)
        folder = root / f'class_{index % classes:03d}'
        folder.mkdir(parents=True, exist_ok=True)
        PIL.Image.fromarray(source.image(index)[:height, :width]).save(folder / f'{index:05d}.jpg', quality=90)
    return root


def make_loaders(source: Callable, split: str, args: argparse.Namespace) -> dict[str, Callable[[], Iterable]]:
    """For each pipeline, a function that runs one pass and yields device batches.

    ``source(transform, split)`` makes the data set with a given transform.
    """
    device = torch.device(args.device)
    nhwc_transform = train_transform(args.crop) if split == 'train' else eval_transform(args.crop, args.resize)
    geometry = nhwc_transform.transforms[:-1]  # everything before ToHWCUint8
    float_transform = transforms.Compose(
        [*geometry, transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    pin = device.type == 'cuda'
    float_loader = DataLoader(
        source(float_transform, split),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=pin,
        persistent_workers=args.workers > 0,
    )
    nhwc_loader = build_loader(
        source(nhwc_transform, split), batch_size=args.batch_size, train=False, workers=args.workers, pin_memory=pin
    )
    normalize = NormalizeBatch()

    def torchvision_pass():
        for images, labels in float_loader:
            yield images.to(device, non_blocking=True), labels.to(device, non_blocking=True)

    def torchvision_nhwc_pass():
        for images, labels in torchvision_pass():
            yield images.to(memory_format=torch.channels_last), labels

    def nhwc_pass():
        for images, labels in nhwc_loader:
            yield normalize((images.to(device, non_blocking=True), labels.to(device, non_blocking=True)))

    return {'torchvision': torchvision_pass, 'torchvision+nhwc': torchvision_nhwc_pass, 'nhwc': nhwc_pass}


def measure(source: Callable, data: str, split: str, args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    runs = make_loaders(source, split, args)
    counts = {}

    def one_pass(name: str, run: Callable[[], Iterable]) -> None:
        counts[name] = sum(images.shape[0] for images, _ in run())

    # one warm-up pass each: worker start, page cache, first allocations
    timings = time_interleaved(
        {name: functools.partial(one_pass, name, runs[name]) for name in PIPELINES},
        rounds=args.repeats,
        warmup=1,
        synchronize=synchronizer(device),
    )
    seconds = timings.seconds
    pixels = args.batch_size * 3 * args.crop**2
    loaded_bytes = {'torchvision': 4 * pixels, 'torchvision+nhwc': 4 * pixels, 'nhwc': pixels}  # float32, uint8
    rows = []
    for name in PIPELINES:
        best, median = min(seconds[name]), statistics.median(seconds[name])
        rows.append(
            {
                'data': data,
                'split': split,
                'workers': args.workers,
                'pipeline': name,
                'images': counts[name],
                'seconds': seconds[name],
                'best_images_per_s': counts[name] / best,
                'median_images_per_s': counts[name] / median,
                'batch_bytes_to_device': loaded_bytes[name],
            }
        )
    for row in rows:  # paired: each pass against the torchvision pass of the same round
        row['speedup_vs_torchvision'] = timings.ratio('torchvision', row['pipeline']).median
    del runs
    gc.collect()  # ends the persistent workers before the next group starts its own
    return rows


def markdown(result: dict) -> str:
    m = result['machine']
    s = result['settings']
    lines = [
        '# Loader throughput: NHWC uint8 path vs torchvision ToTensor + Normalize',
        '',
        f'Machine: {m["cpu"]}, {m["cores_usable"]} usable cores ({m["cores"]} online), '
        f'{m["torch_threads"]} torch thread(s) in the main process, 1 per worker, '
        f'GPU: {m["gpu"] or "none"}; device `{s["device"]}`.',
        f'torch {m["torch"]}, torchvision {m["torchvision"]}, Pillow {m["pillow"]}, numpy {m["numpy"]}, '
        f'Python {m["python"]}.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after the run (other work on the machine makes passes vary).',
        '',
        f'{s["images"]} images per pass, batch {s["batch_size"]}, crop {s["crop"]} (val resize '
        f'{s["resize"]}), {s["repeats"]} timed passes per pipeline after one warm-up, interleaved. '
        'JPEG folder: 224-320 px JPEGs (quality 90); synthetic: the embedded set at '
        f'{s["synthetic_image_size"]} px. Images/s from the fastest and the median pass; '
        '"vs torchvision" is the median over rounds of the torchvision pass time over this '
        'pipeline\'s pass time in the same round (above 1: faster); "to device" is one batch of images '
        'as it leaves the loader.',
        '',
        '| data | split | workers | pipeline | best img/s | median img/s | vs torchvision | to device |',
        '|---|---|---:|---|---:|---:|---:|---:|',
    ]
    for row in result['rows']:
        lines.append(
            f'| {row["data"]} | {row["split"]} | {row["workers"]} | {row["pipeline"]} | '
            f'{row["best_images_per_s"]:.0f} | {row["median_images_per_s"]:.0f} | '
            f'{row["speedup_vs_torchvision"]:.2f}x | {row["batch_bytes_to_device"] / 2**20:.1f} MiB |'
        )
    return '\n'.join(lines) + '\n'


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split('\n\n', 1)[1],
    )
    parser.add_argument('--images', type=int, default=384, help='images per pass (JPEGs written, synthetic size)')
    parser.add_argument('--classes', type=int, default=8, help='class folders of the JPEG set')
    parser.add_argument('--batch-size', type=int, default=64)
    parser.add_argument('--crop', type=int, default=224, help='train and val crop size')
    parser.add_argument('--resize', type=int, default=232, help='val resize of the short side')
    parser.add_argument('--workers', type=int, nargs='+', default=[0, 2], help='DataLoader workers to try')
    parser.add_argument('--splits', nargs='+', choices=('train', 'val'), default=['train', 'val'])
    parser.add_argument('--data', nargs='+', choices=('jpeg', 'synthetic'), default=['jpeg', 'synthetic'])
    parser.add_argument('--repeats', type=int, default=5, help='timed passes per pipeline')
    parser.add_argument(
        '--threads',
        type=int,
        default=1,
        help='torch threads of the main process (workers always use 1); per-image ops on a '
        'busy machine slow down badly with more than one',
    )
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', type=Path, help='folder for loader.json and loader.md (else print only)')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    synthetic_size = round(args.crop * 256 / 224)
    rows = []
    with tempfile.TemporaryDirectory(prefix='loader-bench-') as tmp:
        sources = {}
        if 'jpeg' in args.data:
            folder = write_jpeg_folder(Path(tmp), args.images, args.classes, args.seed)
            sources['jpeg'] = lambda transform, split: CheckedImageFolder(folder, transform)
        if 'synthetic' in args.data:
            sources['synthetic'] = lambda transform, split: SyntheticImageNet(
                args.images, image_size=synthetic_size, split=split, seed=args.seed, transform=transform
            )
        for data, source in sources.items():
            for split in args.splits:
                for workers in args.workers:
                    group = argparse.Namespace(**{**vars(args), 'workers': workers})
                    group_rows = measure(source, data, split, group)
                    rows += group_rows
                    for row in group_rows:
                        print(
                            f'{data:9} {split:5} workers={workers} {row["pipeline"]:16} '
                            f'best {row["best_images_per_s"]:7.0f} img/s  median {row["median_images_per_s"]:7.0f}'
                            f'  ({row["speedup_vs_torchvision"]:.2f}x)',
                            flush=True,
                        )
    result = {
        'command': ' '.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        'machine': {**describe_machine(), 'pillow': PIL.__version__, 'numpy': np.__version__},
        'settings': {
            'images': args.images,
            'batch_size': args.batch_size,
            'crop': args.crop,
            'resize': args.resize,
            'repeats': args.repeats,
            'device': args.device,
            'synthetic_image_size': synthetic_size,
            'seed': args.seed,
        },
        'date': time.strftime('%Y-%m-%d'),
        'load_average_1min': {'before': load_before, 'after': os.getloadavg()[0]},
        'rows': rows,
    }
    if args.out is not None:
        write_results(args.out, 'loader', result, markdown(result))
        print(f'wrote {args.out / "loader.json"} and {args.out / "loader.md"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
