"""Speedup benchmark: this project against NCHW, Composer's ChannelsLast and timm-style conversion.

For each torchvision model, each precision and each of training and inference, the variants
below run in one process, on the same initial weights and the same batch, interleaved round
by round after warm-up, so a noisy machine slows all of them alike:

    nchw                the baseline: the model as built, NCHW input
    composer            composer.algorithms.ChannelsLast as the Trainer applies it at
                        Event.INIT (model.to(memory_format=channels_last)), NCHW input
    timm                timm's --channels-last: the model converted, every input batch
                        converted inside the step (input.contiguous(memory_format=...))
    channels_last_algo  this project, everything on: apply_channels_last(repair=True), the
                        NHWC batches of its data path (no conversion), and for inference the
                        fused oneDNN/cuDNN model of fuse_for_inference
    auto                this project in mode='auto': both layouts timed on the first batch,
                        the faster kept (the decision is in the notes)
    compile             torch.compile with default inductor (--compile): a failure is a row

A training step is forward, loss, backward and optimizer step; an inference step is a forward
pass under inference mode. Reported: min and median step time, images/s, the speedup over
NCHW and over Composer's (median of the per-round ratios, with the interquartile spread as
the noise), and the layout audit's break count for one step of each variant.

    python benchmarks/speedup.py --quick                 # under 10 minutes on a 2-core CPU
    python benchmarks/speedup.py                         # the committed results
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from channels_last_algo.core.audit import LayoutAudit
from channels_last_algo.core.auto import decide_layout
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.fuse import fuse_for_inference
from channels_last_algo.core.machine import describe_machine, machine_label, write_results
from channels_last_algo.app.models import build_model

MODELS = ('resnet50', 'resnext50_32x4d', 'densenet121', 'efficientnet_b0', 'mobilenet_v3_large',
          'shufflenet_v2_x1_0', 'regnet_y_400mf', 'convnext_tiny')
QUICK_MODELS = ('resnet50', 'mobilenet_v3_large', 'convnext_tiny')
VARIANTS = ('nchw', 'composer', 'timm', 'channels_last_algo', 'auto')
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}


class Variant:
    """One way of running a model: the module, whether its input arrives NHWC, and what the
    step does to the input first (timm converts every batch; the rest take it as it comes)."""

    def __init__(self, model: nn.Module, nhwc_input: bool, convert_input: bool = False, note: str = '') -> None:
        self.model, self.nhwc_input, self.convert_input, self.note = model, nhwc_input, convert_input, note
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.times: list[float] = []
        self.breaks: Optional[int] = None
        self.error: Optional[str] = None


def _logits(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, 'logits') else output  # googlenet/inception in train mode


def _run(variant: Variant, batch: dict[bool, tuple[torch.Tensor, torch.Tensor]], train: bool, autocast: Optional[torch.dtype],
         device: torch.device) -> None:
    images, labels = batch[variant.nhwc_input]
    if variant.convert_input:
        images = images.contiguous(memory_format=torch.channels_last)
    with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        if train:
            loss = nn.functional.cross_entropy(_logits(variant.model(images)), labels)
        else:
            with torch.inference_mode():
                variant.model(images)
            return
    loss.backward()
    variant.optimizer.step()
    variant.optimizer.zero_grad(set_to_none=True)


def _auto(base: nn.Module, batch, train: bool, autocast, device) -> Variant:
    model = copy.deepcopy(base)
    apply_channels_last(model, repair=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if train else None
    probe = Variant(model, nhwc_input=True)
    probe.optimizer = optimizer

    def run_step(channels_last: bool) -> None:
        probe.nhwc_input = channels_last
        images, labels = batch[channels_last]
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            if train:
                nn.functional.cross_entropy(_logits(model(images)), labels).backward()
            else:
                with torch.inference_mode():
                    model(images)

    decision = decide_layout(model, run_step, optimizers=optimizer, steps=3)
    if decision.channels_last and not train:
        variant = Variant(fuse_for_inference(model), nhwc_input=True)
    else:
        variant = Variant(model, nhwc_input=decision.channels_last)
    variant.optimizer = optimizer
    variant.note = f'auto kept {decision.layout} ({decision.speedup:.2f}x measured, {decision.cost_seconds:.1f} s)'
    return variant


def build_variants(base: nn.Module, names: tuple[str, ...], batch, train: bool, autocast, device) -> dict[str, Variant]:
    """Every requested variant of ``base`` (deep copies: the same initial weights)."""
    from composer.algorithms.channels_last import apply_channels_last as composer_apply

    variants: dict[str, Variant] = {}
    for name in names:
        try:
            model = copy.deepcopy(base)
            if name == 'nchw':
                variant = Variant(model, nhwc_input=False)
            elif name == 'composer':
                composer_apply(model)
                variant = Variant(model, nhwc_input=False)
            elif name == 'timm':
                model = model.to(memory_format=torch.channels_last)
                variant = Variant(model, nhwc_input=False, convert_input=True)
            elif name == 'channels_last_algo':
                apply_channels_last(model, repair=True)
                variant = Variant(fuse_for_inference(model) if not train else model, nhwc_input=True)
            elif name == 'auto':
                variant = _auto(base, batch, train, autocast, device)
            elif name == 'compile':
                variant = Variant(torch.compile(model), nhwc_input=False)
            else:
                raise ValueError(f'unknown variant {name!r}; choose from {VARIANTS + ("compile",)}')
        except Exception as error:  # a variant that cannot be built is a row that says why
            variant = Variant(base, nhwc_input=False)
            variant.error = f'{type(error).__name__}: {error}'.splitlines()[0][:200]
        if train and variant.optimizer is None and variant.error is None:
            variant.optimizer = torch.optim.SGD(variant.model.parameters(), lr=0.01, momentum=0.9)
        variants[name] = variant
    return variants


def _audit(name: str, variant: Variant, batch, train: bool, autocast, device) -> Optional[int]:
    if name == 'compile' or variant.error:
        return None
    with LayoutAudit(variant.model) as audit:
        _run(variant, batch, train, autocast, device)
    return len(audit.report.breaks)


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def measure(model_name: str, train: bool, dtype: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The rows of one model in one mode and precision."""
    torch.manual_seed(0)
    base = build_model(model_name).to(device).train(train)
    for p in base.parameters():
        p.requires_grad_(train)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
    labels = torch.randint(0, 1000, (args.batch_size,), generator=generator).to(device)
    batch = {True: (images.to(memory_format=torch.channels_last), labels), False: (images, labels)}
    autocast = None if dtype == 'fp32' else DTYPES[dtype]
    names = VARIANTS + (('compile',) if args.compile else ())
    variants = build_variants(base, names, batch, train, autocast, device)

    def timed(variant: Variant) -> float:
        if device.type == 'cuda':
            torch.cuda.synchronize()
        start = time.perf_counter()
        _run(variant, batch, train, autocast, device)
        if device.type == 'cuda':
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for round_index in range(args.warmup + args.steps):
        for variant in variants.values():
            if variant.error:
                continue
            try:
                elapsed = timed(variant)
            except Exception as error:
                variant.error = f'{type(error).__name__}: {error}'.splitlines()[0][:200]
                traceback.print_exc(limit=1)
                continue
            if round_index >= args.warmup:
                variant.times.append(elapsed)
    for name, variant in variants.items():
        variant.breaks = _audit(name, variant, batch, train, autocast, device)

    rows = []
    for name, variant in variants.items():
        row = {'model': model_name, 'mode': 'train' if train else 'infer', 'dtype': dtype, 'variant': name,
               'batch_size': args.batch_size, 'image_size': args.image_size, 'breaks': variant.breaks,
               'note': variant.note, 'error': variant.error, 'times_s': variant.times}
        if variant.times:
            row.update(min_s=min(variant.times), median_s=statistics.median(variant.times),
                       images_per_s=args.batch_size / statistics.median(variant.times))
            for reference in ('nchw', 'composer'):
                ref = variants[reference]
                if ref.times and len(ref.times) == len(variant.times):
                    ratios = [r / v for r, v in zip(ref.times, variant.times)]
                    low, high = _quartiles(ratios)
                    row[f'speedup_vs_{reference}'] = statistics.median(ratios)
                    row[f'noise_vs_{reference}'] = (high - low) / 2
        rows.append(row)
    return rows


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float('nan')


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each with whether this run met it."""
    def find(model, mode, dtype, variant):
        return next((r for r in rows if (r['model'], r['mode'], r['dtype'], r['variant']) == (model, mode, dtype, variant)), None)

    targets = []
    ours = find('resnet50', 'train', 'fp32', 'channels_last_algo')
    if ours and 'speedup_vs_nchw' in ours:
        targets.append({'target': 'ResNet-50 fp32 training >= 1.25x over NCHW', 'value': f"{ours['speedup_vs_nchw']:.2f}x",
                        'met': ours['speedup_vs_nchw'] >= 1.25})
        targets.append({'target': "ResNet-50 fp32 training not slower than Composer's ChannelsLast",
                        'value': f"{ours['speedup_vs_composer']:.2f}x", 'met': ours['speedup_vs_composer'] >= 1 - ours['noise_vs_composer']})
    for mode in ('train', 'infer'):
        for dtype in sorted({r['dtype'] for r in rows}):
            pairs = [(find(r['model'], mode, dtype, 'channels_last_algo'), r) for r in rows
                     if (r['mode'], r['dtype'], r['variant']) == (mode, dtype, 'composer') and 'speedup_vs_nchw' in r]
            pairs = [(o, c) for o, c in pairs if o and 'speedup_vs_nchw' in o]
            if pairs:
                ours_mean = _geomean([o['speedup_vs_nchw'] for o, _ in pairs])
                composer_mean = _geomean([c['speedup_vs_nchw'] for _, c in pairs])
                targets.append({'target': f'{mode} {dtype}: geometric mean speedup of this project above Composer\'s',
                                'value': f'{ours_mean:.2f}x vs {composer_mean:.2f}x over {len(pairs)} models',
                                'met': ours_mean > composer_mean})
            slower = [r for r in rows if (r['mode'], r['dtype'], r['variant']) == (mode, dtype, 'auto')
                      and 'speedup_vs_nchw' in r and r['speedup_vs_nchw'] < 1 - max(r['noise_vs_nchw'], 0.03)]
            auto_rows = [r for r in rows if (r['mode'], r['dtype'], r['variant']) == (mode, dtype, 'auto')]
            if auto_rows:
                targets.append({'target': f'{mode} {dtype}: auto mode slower than NCHW beyond noise on no model',
                                'value': ', '.join(f"{r['model']} {r['speedup_vs_nchw']:.2f}x" for r in slower) or 'none slower',
                                'met': not slower})
    return targets


def markdown(result: dict) -> str:
    lines = [f"# Training and inference speedup: {machine_label(result['machine'])}", '',
             f"Command: `{result['command']}`", '',
             f"Batch {result['settings']['batch_size']} x 3 x {result['settings']['image_size']} x "
             f"{result['settings']['image_size']}, {result['settings']['steps']} timed steps per variant after "
             f"{result['settings']['warmup']} warm-up, interleaved round by round in one process. Speedups are the "
             'median of per-round ratios (+- half the interquartile range); breaks: layout audit of one step.', '']
    lines += ['## Targets', '', '| target | this run | met |', '|---|---|---|']
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else '**no**'} |" for t in result['targets']]
    groups = sorted({(r['mode'], r['dtype']) for r in result['rows']}, key=lambda g: (g[0] != 'train', g[1] != 'fp32', g))
    for mode, dtype in groups:
        lines += ['', f'## {"Training" if mode == "train" else "Inference"}, {dtype}', '',
                  '| model | variant | median ms | min ms | images/s | vs NCHW | vs Composer | breaks | notes |',
                  '|---|---|---:|---:|---:|---:|---:|---:|---|']
        for r in (r for r in result['rows'] if (r['mode'], r['dtype']) == (mode, dtype)):
            if r['error'] or not r['times_s']:
                lines.append(f"| {r['model']} | {r['variant']} | failed | | | | | | {r['error'] or 'no timing'} |")
                continue
            vs = lambda key: f"{r[f'speedup_vs_{key}']:.2f}x +- {r[f'noise_vs_{key}']:.2f}" if f'speedup_vs_{key}' in r else ''
            lines.append(f"| {r['model']} | {r['variant']} | {r['median_s'] * 1e3:.1f} | {r['min_s'] * 1e3:.1f} | "
                         f"{r['images_per_s']:.1f} | {vs('nchw')} | {vs('composer')} | "
                         f"{'' if r['breaks'] is None else r['breaks']} | {r['note']} |")
    return '\n'.join(lines) + '\n'


def chart(result: dict, path: Path) -> Optional[Path]:
    """A bar chart of the speedups over NCHW, one panel per mode and precision (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install -e .[bench]); no chart written', file=sys.stderr)
        return None
    groups = sorted({(r['mode'], r['dtype']) for r in result['rows']}, key=lambda g: (g[0] != 'train', g[1] != 'fp32', g))
    variants = [v for v in VARIANTS + ('compile',) if v != 'nchw' and any(r['variant'] == v for r in result['rows'])]
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 3.2 * len(groups)), squeeze=False)
    for ax, (mode, dtype) in zip(axes[:, 0], groups):
        models = list(dict.fromkeys(r['model'] for r in result['rows'] if (r['mode'], r['dtype']) == (mode, dtype)))
        width = 0.8 / len(variants)
        for index, variant in enumerate(variants):
            values = [next((r.get('speedup_vs_nchw', 0) for r in result['rows']
                            if (r['model'], r['mode'], r['dtype'], r['variant']) == (m, mode, dtype, variant)), 0) for m in models]
            ax.bar([i + index * width for i in range(len(models))], values, width, label=variant)
        ax.axhline(1.0, color='black', linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, fontsize=8)
        ax.set_ylabel('speedup vs NCHW')
        ax.set_title(f'{"training" if mode == "train" else "inference"}, {dtype}', fontsize=10)
    axes[0, 0].legend(ncol=len(variants), fontsize=8, loc='upper left')
    fig.suptitle(machine_label(result['machine']), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_out(device: torch.device) -> Path:
    """``benchmarks/results/<machine>``: the GPU's name, or ``cpu-<N>core``."""
    if device.type == 'cuda':
        slug = torch.cuda.get_device_name().lower().replace(' ', '-')
    else:
        slug = f'cpu-{len(os.sched_getaffinity(0))}core'
    return Path(__file__).resolve().parent / 'results' / slug


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split('\n\n', 1)[1])
    parser.add_argument('--models', nargs='+', default=None, help=f'torchvision model names (default: {" ".join(MODELS)})')
    parser.add_argument('--modes', nargs='+', choices=('train', 'infer'), default=['train', 'infer'])
    parser.add_argument('--dtypes', nargs='+', choices=tuple(DTYPES), default=None,
                        help='fp32 and bf16 autocast on CPU (default); fp32 and fp16 autocast on GPU')
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--image-size', type=int, default=128)
    parser.add_argument('--steps', type=int, default=5, help='timed rounds per variant')
    parser.add_argument('--warmup', type=int, default=2, help='untimed rounds per variant first')
    parser.add_argument('--compile', action='store_true', help='add a torch.compile (inductor) variant')
    parser.add_argument('--quick', action='store_true',
                        help=f'{", ".join(QUICK_MODELS)} at batch 16 x 96 px, 3 steps: under 10 minutes on 2 CPU cores')
    parser.add_argument('--out', type=Path, default=None, help='results folder (default: benchmarks/results/<machine>)')
    parser.add_argument('--name', default='speedup', help='file name stem of the results (default: speedup)')
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.batch_size, args.image_size, args.steps, args.warmup = 16, 96, 3, 1
    args.models = args.models or list(MODELS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    dtypes = args.dtypes or (['fp32', 'fp16'] if device.type == 'cuda' else ['fp32', 'bf16'])
    out = args.out or default_out(device)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    started = time.perf_counter()
    for model_name in args.models:
        for mode in args.modes:
            for dtype in dtypes:
                print(f'[{time.perf_counter() - started:6.0f} s] {model_name} {mode} {dtype}', flush=True)
                rows.extend(measure(model_name, mode == 'train', dtype, args, device))
    result = {
        'command': 'python benchmarks/speedup.py ' + ' '.join(sys.argv[1:] if argv is None else argv),
        'machine': describe_machine(),
        'settings': {'batch_size': args.batch_size, 'image_size': args.image_size, 'steps': args.steps,
                     'warmup': args.warmup, 'device': device.type},
        'load_average_1min': os.getloadavg()[0],
        'seconds': time.perf_counter() - started,
        'rows': rows,
    }
    result['targets'] = check_targets(rows)
    write_results(out, args.name, result, markdown(result))
    chart(result, out / f'{args.name}.png')
    print(markdown(result))
    print(f'results in {out}, {result["seconds"]:.0f} s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
