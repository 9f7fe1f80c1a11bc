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
import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import torch
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from results_writer import RunStart, results_folder, run_record, write_results
from speedup_report import VARIANTS, chart, check_targets, markdown
from torch import nn

from channels_last_algo.app.recipes.models import build_model
from channels_last_algo.core.audit import LayoutAudit
from channels_last_algo.core.auto import decide_layout
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.fuse import fuse_for_inference
from channels_last_algo.core.machine_description import describe_machine
from channels_last_algo.core.timing import Ratio, synchronizer, time_interleaved

MODELS = (
    'resnet50',
    'resnext50_32x4d',
    'densenet121',
    'efficientnet_b0',
    'mobilenet_v3_large',
    'shufflenet_v2_x1_0',
    'regnet_y_400mf',
    'convnext_tiny',
)
QUICK_MODELS = ('resnet50', 'mobilenet_v3_large', 'convnext_tiny')
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


def _run(
    variant: Variant,
    batch: dict[bool, tuple[torch.Tensor, torch.Tensor]],
    train: bool,
    autocast: Optional[torch.dtype],
    device: torch.device,
) -> None:
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

    decision = decide_layout(model, run_step, optimizers=optimizer)
    if decision.channels_last and not train:
        variant = Variant(fuse_for_inference(model), nhwc_input=True)
    else:
        variant = Variant(model, nhwc_input=decision.channels_last)
    variant.optimizer = optimizer
    variant.note = (
        f'auto kept {decision.layout}{" (a tie: the default)" if decision.tie else ""} '
        f'({decision.speedup:.2f}x measured over {decision.rounds} rounds, {decision.cost_seconds:.1f} s)'
    )
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


def fixed_batch(args: argparse.Namespace, device: torch.device) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """The one batch every variant runs on, by whether it arrives NHWC: ``{nhwc: (images, labels)}``."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
    labels = torch.randint(0, 1000, (args.batch_size,), generator=generator).to(device)
    return {True: (images.to(memory_format=torch.channels_last), labels), False: (images, labels)}


def time_variants(
    variants: dict[str, Variant], step: Callable[[Variant], None], args: argparse.Namespace, device: torch.device
) -> None:
    """Time the variants that were built (``step`` runs one), interleaved; a variant that raised keeps
    its error and is left out of the ratios."""
    live = {name: variant for name, variant in variants.items() if not variant.error}
    timings = time_interleaved(
        {name: functools.partial(step, variant) for name, variant in live.items()},
        rounds=args.steps,
        warmup=args.warmup,
        synchronize=synchronizer(device),
        catch=True,
    )
    for name, variant in live.items():
        variant.times, variant.error = timings.seconds[name], timings.errors.get(name)


def timing_fields(variant: Variant, variants: dict[str, Variant], batch_size: int) -> dict[str, float]:
    """Min and median step time, images/s, and the paired speedups over NCHW and Composer with their noise."""
    if not variant.times:
        return {}
    median = statistics.median(variant.times)
    fields = {'min_s': min(variant.times), 'median_s': median, 'images_per_s': batch_size / median}
    for reference in ('nchw', 'composer'):
        ref = variants[reference]
        if ref.times and len(ref.times) == len(variant.times):
            ratio = Ratio.of([r / v for r, v in zip(ref.times, variant.times)])
            fields[f'speedup_vs_{reference}'] = ratio.median
            fields[f'noise_vs_{reference}'] = ratio.noise
    return fields


def measure(model_name: str, train: bool, dtype: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The rows of one model in one mode and precision."""
    torch.manual_seed(0)
    base = build_model(model_name).to(device).train(train)
    for p in base.parameters():
        p.requires_grad_(train)
    batch = fixed_batch(args, device)
    autocast = None if dtype == 'fp32' else DTYPES[dtype]
    names = VARIANTS + (('compile',) if args.compile else ())
    variants = build_variants(base, names, batch, train, autocast, device)
    time_variants(variants, lambda variant: _run(variant, batch, train, autocast, device), args, device)
    for name, variant in variants.items():
        variant.breaks = _audit(name, variant, batch, train, autocast, device)
    rows = []
    for name, variant in variants.items():
        row = {
            'model': model_name,
            'mode': 'train' if train else 'infer',
            'dtype': dtype,
            'variant': name,
            'batch_size': args.batch_size,
            'image_size': args.image_size,
            'breaks': variant.breaks,
            'note': variant.note,
            'error': variant.error,
            'times_s': variant.times,
        }
        rows.append({**row, **timing_fields(variant, variants, args.batch_size)})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        rounds=Option(5, 'timed rounds per variant', flag='--steps'),
        warmup=Option(2, 'untimed rounds per variant first'),
        out='results folder (default: benchmarks/results/<machine>)',
        name=Option('speedup', 'file name stem of the results (default: speedup)'),
    )
    parser.add_argument(
        '--models', nargs='+', default=None, help=f'torchvision model names (default: {" ".join(MODELS)})'
    )
    parser.add_argument('--modes', nargs='+', choices=('train', 'infer'), default=['train', 'infer'])
    parser.add_argument(
        '--dtypes',
        nargs='+',
        choices=tuple(DTYPES),
        default=None,
        help='fp32 and bf16 autocast on CPU (default); fp32 and fp16 autocast on GPU',
    )
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--image-size', type=int, default=128)
    parser.add_argument('--compile', action='store_true', help='add a torch.compile (inductor) variant')
    parser.add_argument(
        '--quick',
        action='store_true',
        help=f'{", ".join(QUICK_MODELS)} at batch 16 x 96 px, 3 steps: under 10 minutes on 2 CPU cores',
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models = args.models or list(QUICK_MODELS)
        args.batch_size, args.image_size, args.steps, args.warmup = 16, 96, 3, 1
    args.models = args.models or list(MODELS)
    return args


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    if device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    dtypes = args.dtypes or (['fp32', 'fp16'] if device.type == 'cuda' else ['fp32', 'bf16'])
    out = results_folder(args.out, describe_machine())
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for model_name in args.models:
        for mode in args.modes:
            for dtype in dtypes:
                print(f'[{time.perf_counter() - start.clock:6.0f} s] {model_name} {mode} {dtype}', flush=True)
                rows.extend(measure(model_name, mode == 'train', dtype, args, device))
    keys = ('batch_size', 'image_size', 'steps', 'warmup')
    settings = {**{key: getattr(args, key) for key in keys}, 'device': device.type}
    result = run_record('speedup', start, argv, settings=settings, rows=rows, targets=check_targets(rows))
    write_results(out, args.name, result, markdown(result))
    chart(result, out / f'{args.name}.png')
    print(markdown(result))
    print(f'results in {out}, {result["seconds"]:.0f} s')
    return 0


if __name__ == '__main__':
    sys.exit(main())
