"""Inference throughput: fused NHWC inference against eager NCHW, channels last, Composer and TorchScript.

Every variant runs the same weights on the same batch, in one process:

    nchw           the eager model, NCHW input (1.00x: the baseline)
    channels_last  model.to(memory_format=torch.channels_last), NHWC input
    composer       composer.algorithms.channels_last.apply_channels_last(model): the model only,
                   NCHW input, as Composer's ChannelsLast leaves evaluation
    torchscript    torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(model)))
    fused          channels_last_algo.fuse_for_inference(model): BatchNorm folded, activations and
                   residual adds fused into oneDNN (CPU) / cuDNN (GPU) convolutions, NHWC, prepacked
                   weights; NHWC input
    export         fuse_for_inference(model, traceable=True) saved with torch.export and loaded back
                   with torch.export.load (what `channels-last export` writes; CPU float32 only)

In bfloat16 (CPU) and float16 (GPU) the eager variants and `fused` run under autocast; TorchScript
(whose frozen graphs autocast does not reach) and `fused (copy)` run a copy converted to that dtype.

Each (model, dtype) group builds its variants, calls each --warmup times, then times --rounds
interleaved rounds (every variant once per round, in turn, so load on the machine hits all
alike); a measurement is --iterations calls, or as many as make the NCHW model take about
--min-seconds. The table gives images/s of the best and the median round, and the speedup over
`nchw`: the median over rounds of the NCHW time over the variant's time in the same round.

Example:
    flock /tmp/channels_last_timing.lock .venv/bin/python benchmarks/inference.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from composer.algorithms.channels_last import apply_channels_last as composer_channels_last

from channels_last_algo.core.fuse import export_for_inference, fuse_for_inference
from channels_last_algo.core.machine import describe_machine, machine_label, write_results
from channels_last_algo.app.models import build_model

VARIANTS = ('nchw', 'channels_last', 'composer', 'torchscript', 'fused', 'fused (copy)', 'export')
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


class Variant:
    """One way of running the model: a callable on one input, and how it was made."""

    def __init__(self, name: str, run: Callable[[], Any], how: str) -> None:
        self.name, self.run, self.how = name, run, how


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def build_variants(model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype, names: tuple[str, ...],
                   workdir: Path) -> tuple[list[Variant], dict[str, Any]]:
    """The variants of ``model`` on ``images`` in ``dtype``, and notes (fusion summary, skips)."""
    device = images.device
    nhwc = images.to(memory_format=torch.channels_last)
    low = dtype != torch.float32
    autocast_how = f'autocast {dtype}'.replace('torch.', '') if low else 'float32'
    notes: dict[str, Any] = {'skipped': {}}
    variants = []

    def under_autocast(module: torch.nn.Module, inputs: torch.Tensor) -> Callable[[], Any]:
        def run():
            with _autocast(device, dtype):
                return module(inputs)
        return run

    if 'nchw' in names:
        variants.append(Variant('nchw', under_autocast(model, images), f'eager, NCHW input, {autocast_how}'))
    if 'channels_last' in names:
        converted = copy.deepcopy(model).to(memory_format=torch.channels_last)
        variants.append(Variant('channels_last', under_autocast(converted, nhwc),
                                f'model.to(channels_last), NHWC input, {autocast_how}'))
    if 'composer' in names:
        composer = copy.deepcopy(model)
        composer_channels_last(composer)
        variants.append(Variant('composer', under_autocast(composer, images),
                                f"Composer's apply_channels_last, NCHW input, {autocast_how}"))
    if 'torchscript' in names:
        scripted = torch.jit.script(copy.deepcopy(model).to(dtype))
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(scripted))
        typed = images.to(dtype)
        variants.append(Variant('torchscript', lambda: frozen(typed),
                                f'script + freeze + optimize_for_inference, {dtype}'.replace('torch.', '')))
    if 'fused' in names or 'fused (copy)' in names:
        fused = fuse_for_inference(model, images[:2])
        notes['fusion'] = str(fused.summary)
        if 'fused' in names:
            variants.append(Variant('fused', under_autocast(fused, nhwc),
                                    f'fuse_for_inference, NHWC input, {autocast_how}'))
        if 'fused (copy)' in names and not low:
            notes['skipped']['fused (copy)'] = 'a converted copy is the float32 model itself'
        elif 'fused (copy)' in names:
            fused_copy = copy.deepcopy(fused).to(dtype)
            typed = nhwc.to(dtype)
            variants.append(Variant('fused (copy)', lambda: fused_copy(typed),
                                    f'fuse_for_inference(...).to({dtype}), NHWC input'.replace('torch.', '')))
    if 'export' in names:
        if low or device.type != 'cpu':
            notes['skipped']['export'] = 'the exported program is traced in float32 on CPU'
        else:
            path = workdir / f'{type(model).__name__}.pt2'
            export_for_inference(model, path, images[:2])
            program = torch.export.load(path).module()
            variants.append(Variant('export', lambda: program(nhwc), 'torch.export.load(fused .pt2), NHWC input'))
    return variants, notes


def _synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_calls(run: Callable[[], Any], iterations: int, device: torch.device) -> float:
    """Seconds per call of ``run``, over ``iterations`` calls."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        run()
    _synchronize(device)
    return (time.perf_counter() - start) / iterations


def measure(name: str, dtype_name: str, args: argparse.Namespace, workdir: Path) -> dict:
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = DTYPES[dtype_name]
    torch.manual_seed(args.seed)
    model = build_model(name).eval().to(device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    with torch.inference_mode():
        variants, notes = build_variants(model, images, dtype, tuple(args.variants), workdir)
        for variant in variants:
            for _ in range(args.warmup):
                variant.run()
        baseline = next((v for v in variants if v.name == 'nchw'), variants[0])
        iterations = args.iterations or max(1, math.ceil(args.min_seconds / time_calls(baseline.run, 1, device)))
        seconds: dict[str, list[float]] = {v.name: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                seconds[variant.name].append(time_calls(variant.run, iterations, device))
    rows = []
    for variant in variants:
        own = seconds[variant.name]
        ratios = [base / mine for base, mine in zip(seconds[baseline.name], own)]
        rows.append({
            'model': name,
            'dtype': dtype_name,
            'variant': variant.name,
            'how': variant.how,
            'seconds_per_batch': own,
            'best_images_per_s': args.batch_size / min(own),
            'median_images_per_s': args.batch_size / statistics.median(own),
            'speedup_vs_nchw': statistics.median(ratios),
        })
    del variants, model
    gc.collect()
    return {'model': name, 'dtype': dtype_name, 'iterations': iterations, 'rows': rows,
            'wall_seconds': time.perf_counter() - start, **notes}


def _row(group: dict, variant: str) -> Optional[dict]:
    return next((row for row in group['rows'] if row['variant'] == variant), None)


def resnet50_verdict(groups: list[dict], batch_size: int, image_size: int) -> Optional[str]:
    """Whether ResNet-50 float32 fused beats TorchScript and reaches 1.7x over NCHW eager."""
    group = next((g for g in groups if g['model'] == 'resnet50' and g['dtype'] == 'float32'), None)
    fused = None if group is None else _row(group, 'fused')
    script = None if group is None else _row(group, 'torchscript')
    if fused is None or script is None:
        return None
    faster = fused['median_images_per_s'] > script['median_images_per_s']
    enough = fused['speedup_vs_nchw'] >= 1.7
    verdict = 'met' if faster and enough else 'MISSED'
    return (f"ResNet-50 float32, batch {batch_size} at {image_size}x{image_size}: fused "
            f"{fused['speedup_vs_nchw']:.2f}x over NCHW eager (target 1.7x: {'reached' if enough else 'not reached'}), "
            f"{fused['median_images_per_s'] / script['median_images_per_s']:.2f}x TorchScript freeze's median "
            f"throughput ({'faster' if faster else 'not faster'}): target {verdict}.")


def bf16_note(groups: list[dict]) -> list[str]:
    """Per model: the fused path under autocast against the converted copy."""
    lines = []
    for group in groups:
        autocast, converted = _row(group, 'fused'), _row(group, 'fused (copy)')
        if group['dtype'] != 'float32' and autocast and converted:
            ratio = converted['median_images_per_s'] / autocast['median_images_per_s']
            lines.append(f"{group['model']} {group['dtype']}: the converted copy runs at {ratio:.2f}x the autocast "
                         'median throughput')
    return lines


def markdown(result: dict) -> str:
    m, s = result['machine'], result['settings']
    lines = [
        '# Inference throughput: fused NHWC against NCHW eager, channels last, Composer and TorchScript',
        '',
        f"Machine: {machine_label(m)}; {m['cores_usable']} usable cores ({m['cores']} online), "
        f"GPU: {m['gpu'] or 'none'}; device `{s['device']}`. Python {m['python']}, torchvision {m['torchvision']}.",
        '',
        f"Command: `{result['command']}` ({result['date']})",
        '',
        f"1-minute load average {result['load_average_1min']['before']:.1f} before and "
        f"{result['load_average_1min']['after']:.1f} after the run (other work on the machine makes rounds vary).",
        '',
        f"Batch {s['batch_size']} at {s['image_size']}x{s['image_size']}, random weights (torchvision, "
        f"`weights=None`), {s['warmup']} warm-up calls per variant, {s['rounds']} interleaved timed rounds. "
        'Images/s from the best and the median round; "vs NCHW" is the median over rounds of the NCHW '
        "time over the variant's time in the same round (above 1: faster).",
        '',
    ]
    verdict = resnet50_verdict(result['groups'], s['batch_size'], s['image_size'])
    if verdict:
        lines += [f'**{verdict}**', '']
    lines += ['| model | dtype | variant | best img/s | median img/s | vs NCHW | how |',
              '|---|---|---|---:|---:|---:|---|']
    for group in result['groups']:
        for row in group['rows']:
            lines.append(f"| {row['model']} | {row['dtype']} | {row['variant']} | {row['best_images_per_s']:.1f} | "
                         f"{row['median_images_per_s']:.1f} | {row['speedup_vs_nchw']:.2f}x | {row['how']} |")
    lines += ['', 'What was fused (fx route: patterns matched on a symbolic trace):', '']
    seen = set()
    for group in result['groups']:
        if 'fusion' in group and group['model'] not in seen:
            seen.add(group['model'])
            lines.append(f"- {group['model']}: {group['fusion']}")
    notes = bf16_note(result['groups'])
    if notes:
        lines += ['', 'Reduced precision, fused path, autocast against a converted copy:', '']
        lines += [f'- {line}' for line in notes]
    skipped = sorted({f'{name}: {why}' for group in result['groups'] for name, why in group['skipped'].items()})
    if skipped:
        lines += ['', 'Not measured: ' + '; '.join(skipped) + '.']
    return '\n'.join(lines) + '\n'


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split('\n\n', 1)[1])
    parser.add_argument('--models', nargs='+', default=['resnet50', 'mobilenet_v2', 'efficientnet_b0',
                                                         'regnet_y_400mf', 'densenet121'],
                        help='torchvision model names (default: %(default)s)')
    parser.add_argument('--dtypes', nargs='+', choices=sorted(DTYPES),
                        default=['float32', 'float16'] if cuda else ['float32', 'bfloat16'],
                        help='float32 and the reduced precision of the device (default: %(default)s)')
    parser.add_argument('--variants', nargs='+', choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--image-size', type=int, default=224)
    parser.add_argument('--warmup', type=int, default=2, help='untimed calls per variant first (default 2)')
    parser.add_argument('--rounds', type=int, default=5, help='timed interleaved rounds (default 5)')
    parser.add_argument('--iterations', type=int, help='calls per measurement (default: as many as make the '
                        'NCHW model take --min-seconds)')
    parser.add_argument('--min-seconds', type=float, default=0.3)
    parser.add_argument('--device', default='cuda' if cuda else 'cpu')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', type=Path, help='folder for inference.json and inference.md (else print only)')
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    groups = []
    with tempfile.TemporaryDirectory(prefix='inference-bench-') as tmp:
        for name in args.models:
            for dtype_name in args.dtypes:
                group = measure(name, dtype_name, args, Path(tmp))
                groups.append(group)
                for row in group['rows']:
                    print(f"{name:16} {dtype_name:9} {row['variant']:14} best {row['best_images_per_s']:7.1f} img/s  "
                          f"median {row['median_images_per_s']:7.1f}  ({row['speedup_vs_nchw']:.2f}x)", flush=True)
                print(f"{name} {dtype_name}: {group['wall_seconds']:.0f} s with building and warm-up", flush=True)
    result = {
        'command': ' '.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        'machine': describe_machine(),
        'settings': {key: getattr(args, key) for key in ('batch_size', 'image_size', 'warmup', 'rounds', 'iterations',
                                                          'min_seconds', 'device', 'seed')},
        'date': time.strftime('%Y-%m-%d'),
        'load_average_1min': {'before': load_before, 'after': os.getloadavg()[0]},
        'groups': groups,
    }
    verdict = resnet50_verdict(groups, args.batch_size, args.image_size)
    if verdict:
        print(verdict)
    if args.out is not None:
        write_results(args.out, 'inference', result, markdown(result))
        print(f'wrote {args.out / "inference.json"} and {args.out / "inference.md"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
