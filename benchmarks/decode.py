"""Per-image cost of each way to read, decode and resize an ImageNet-like JPEG: the measurements
behind the choices in ``channels_last_algo/app/data/decode.py`` and ``transforms.py``.

One thread, one process, every option over the same generated JPEGs (``imagenet_jpegs.py``),
interleaved round by round:

    header   Pillow's Image.open (size only)  |  the start-of-frame walk (EncodedImage)
    decode   Pillow full + np.asarray  |  EncodedImage at 1/2, 1/4, 1/8 (the scaled IDCT: simplejpeg,
             else Pillow draft)  |  each installed entry of
             FULL_SIZE_DECODERS (simplejpeg, the ``jpeg`` extra; torchvision.io.decode_jpeg)
    resize   a random-resized-crop box to 224 px, and the whole image to a 232 px short side:
             Pillow (what torchvision runs on PIL images)  |  torch antialiased uint8 on the
             strided crop  |  the same after copying the crop to a dense NHWC block

Example:
    flock /tmp/channels_last_timing.lock .venv/bin/python benchmarks/decode.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import PIL
import PIL.features
import torch
import torch.nn.functional as F
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from imagenet_jpegs import write_imagenet_like_folder
from PIL import Image
from results_writer import RunStart, run_record, write_results
from torchvision import transforms

from channels_last_algo.app.data.decode import FULL_SIZE_DECODERS, EncodedImage, rgb_pixels
from channels_last_algo.core.timing import time_interleaved

try:
    import simplejpeg
except ImportError:
    simplejpeg = None


def decode_options() -> dict[str, Callable[[bytes], object]]:
    """Pillow as torchvision's ImageFolder decodes, the package's scaled decodes, and each of
    its installed full-size decoders (``FULL_SIZE_DECODERS``)."""
    options = {
        'header: Pillow Image.open': lambda data: Image.open(io.BytesIO(data)).size,
        'header: start-of-frame walk': lambda data: EncodedImage(data).size,
        'decode: Pillow full + asarray': lambda data: rgb_pixels(Image.open(io.BytesIO(data))),
        **{
            f'decode: EncodedImage 1/{shrink}': lambda data, shrink=shrink: EncodedImage(data).decode(shrink)
            for shrink in (2, 4, 8)
        },
    }
    options.update({f'decode: {name}': decoder for name, decoder, _ in FULL_SIZE_DECODERS})
    return options


def resize_options(crop: int, resize: int) -> dict[str, Callable[[torch.Tensor, Image.Image, tuple], object]]:
    """Each takes the decoded image as a (1, 3, H, W) NHWC tensor, as a PIL image, and a crop box."""

    def torch_resize(pixels: torch.Tensor, size: tuple[int, int], dense: bool) -> torch.Tensor:
        if dense:
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        return F.interpolate(pixels, size=size, mode='bilinear', antialias=True, align_corners=False)

    def short_side(height: int, width: int) -> tuple[int, int]:
        return (int(resize * height / width), resize) if width <= height else (resize, int(resize * width / height))

    def crop_of(pixels: torch.Tensor, box: tuple) -> torch.Tensor:
        top, left, height, width = box
        return pixels[..., top : top + height, left : left + width]

    return {
        'crop: Pillow resize (torchvision on PIL)': lambda t, p, box: transforms.functional.resized_crop(
            p, *box, [crop, crop]
        ),
        'crop: torch uint8, strided': lambda t, p, box: torch_resize(crop_of(t, box), (crop, crop), False),
        'crop: torch uint8, dense copy first': lambda t, p, box: torch_resize(crop_of(t, box), (crop, crop), True),
        'short side: Pillow resize': lambda t, p, box: p.resize(short_side(p.height, p.width)[::-1], Image.BILINEAR),
        'short side: torch uint8': lambda t, p, box: torch_resize(t, short_side(*t.shape[2:]), True),
    }


def measure(folder: Path, args: argparse.Namespace) -> list[dict]:
    datas = [path.read_bytes() for path in sorted(folder.rglob('*.JPEG'))]
    decoded = [EncodedImage(data).decode()[None] for data in datas]
    pils = [Image.fromarray(pixels[0].permute(1, 2, 0).numpy()) for pixels in decoded]
    torch.manual_seed(args.seed)
    boxes = [transforms.RandomResizedCrop.get_params(pixels, [0.08, 1.0], [3 / 4, 4 / 3]) for pixels in decoded]
    calls = {name: (lambda fn=fn: [fn(data) for data in datas]) for name, fn in decode_options().items()}
    for name, fn in resize_options(args.crop, args.resize).items():
        calls[name] = lambda fn=fn: [fn(t, p, box) for t, p, box in zip(decoded, pils, boxes)]
    timings = time_interleaved(calls, rounds=args.repeats, warmup=1)
    return [
        {
            'option': name,
            'best_ms_per_image': 1e3 * timings.min(name) / len(datas),
            'median_ms_per_image': 1e3 * timings.median(name) / len(datas),
        }
        for name in calls
    ]


def markdown(result: dict) -> str:
    m, s = result['machine'], result['settings']
    d = result['data']
    lines = [
        '# Per-image decode and resize cost on ImageNet-like JPEGs',
        '',
        f'Machine: {m["cpu"]}, 1 torch thread, one process. torch {m["torch"]}, torchvision '
        f'{m["torchvision"]}, Pillow {m["pillow"]} (libjpeg-turbo {m["libjpeg_turbo"]}), simplejpeg '
        f'{m["simplejpeg"] or "not installed"}, Python {m["python"]}.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after.',
        '',
        f'{d["images"]} generated JPEGs (quality {d["quality"]}), mean {d["mean_width"]:.0f} x '
        f'{d["mean_height"]:.0f} px, mean {d["mean_kib"]:.0f} KiB; {s["repeats"]} timed rounds after one '
        f'warm-up, options interleaved. Crop: a RandomResizedCrop box per image (seed {s["seed"]}) resized to '
        f'{s["crop"]} px; short side: the whole image to {s["resize"]} px.',
        '',
        '| option | best ms/image | median ms/image |',
        '|---|---:|---:|',
    ]
    for row in result['rows']:
        lines.append(f'| {row["option"]} | {row["best_ms_per_image"]:.3f} | {row["median_ms_per_image"]:.3f} |')
    return '\n'.join(lines) + '\n'


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(7, 'timed rounds', flag='--repeats'),
        out='folder for decode.json and decode.md (else print only)',
    )
    parser.add_argument('--images', type=int, default=64, help='JPEGs generated')
    parser.add_argument('--crop', type=int, default=224)
    parser.add_argument('--resize', type=int, default=232)
    parser.add_argument('--seed', type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix='decode-bench-') as tmp:
        data = write_imagenet_like_folder(Path(tmp), args.images, classes=1, seed=args.seed)
        rows = measure(Path(tmp), args)
    for row in rows:
        print(f'{row["option"]:45} best {row["best_ms_per_image"]:.3f} ms  median {row["median_ms_per_image"]:.3f} ms')
    machine = {
        'pillow': PIL.__version__,
        'libjpeg_turbo': PIL.features.version('libjpeg_turbo'),
        'simplejpeg': getattr(simplejpeg, '__version__', None),
    }
    settings = {'crop': args.crop, 'resize': args.resize, 'repeats': args.repeats, 'seed': args.seed}
    result = run_record('decode', start, argv, machine, settings=settings, data=data, rows=rows)
    if args.out is not None:
        write_results(args.out, 'decode', result, markdown(result))
        print(f'wrote {args.out / "decode.json"} and {args.out / "decode.md"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
