"""Inference throughput: fused NHWC inference against eager NCHW, channels last, Composer, TorchScript and inductor.

Every variant runs the same weights on the same batch, in one process:

    nchw              the eager model, NCHW input (1.00x: the baseline)
    channels_last     model.to(memory_format=torch.channels_last), NHWC input
    composer          composer.algorithms.channels_last.apply_channels_last(model): the model only,
                      NCHW input, as Composer's ChannelsLast leaves evaluation (where Composer is installed)
    torchscript       torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(model)))
    inductor          the strongest peer on current torch: torch.compile(model.to(channels_last)) with
                      torch._inductor.config.freezing = True (weights as constants: BatchNorm folded,
                      conv + post-op fusion on prepacked oneDNN weights), NHWC input
    fused             channels_last_algo.fuse_for_inference(model): BatchNorm folded, activations and
                      residual adds fused into oneDNN (CPU) / cuDNN (GPU) convolutions, NHWC, prepacked
                      weights; NHWC input
    fused (copy)      the fused copy converted to the reduced precision (bfloat16 / float16 groups only)
    fused (inductor)  fuse_for_inference(model, backend='inductor'): the fused copy compiled by inductor
                      with freezing
    export            fuse_for_inference(model, traceable=True) saved with torch.export and loaded back
                      with torch.export.load (what `channels-last export` writes; CPU float32 only)

In bfloat16 (CPU) and float16 (GPU) the eager, inductor and fused variants run under autocast;
TorchScript (whose frozen graphs autocast does not reach) and `fused (copy)` run a copy converted to
that dtype.

Each (model, dtype) group builds its variants and calls each once (the compiled ones compile
then; the time is reported), then times them with the project's interleaved timer
(channels_last_algo.core.timing: --warmup untimed rounds, --rounds timed rounds, the order
rotated each round, so load on the machine hits all alike); a measurement is --iterations calls,
or as many as make the NCHW model take about --min-seconds. The table gives images/s of the best
and the median round, the speedup over `nchw` and over `inductor`: the median over rounds of the
other's time over the variant's time in the same round, with its 95% interval.

Example (the full run; --smoke checks the script in a few minutes, timings meaningless):
    flock /tmp/channels_last_timing.lock .venv-newest/bin/python benchmarks/inference.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from inference_report import inductor_verdicts, markdown, times  # benchmarks/, next to this script

from channels_last_algo.app.models import build_model
from channels_last_algo.core.fuse import export_for_inference, fuse_for_inference
from channels_last_algo.core.machine import describe_machine, write_results
from channels_last_algo.core.timing import synchronizer, time_interleaved

VARIANTS = (
    'nchw',
    'channels_last',
    'composer',
    'torchscript',
    'inductor',
    'fused',
    'fused (copy)',
    'fused (inductor)',
    'export',
)
DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
MODELS = ('resnet50', 'mobilenet_v2', 'efficientnet_b0', 'regnet_y_400mf', 'densenet121')
SMOKE = {'models': ['resnet18'], 'batch_size': 2, 'image_size': 32, 'warmup': 1, 'rounds': 2, 'iterations': 1}


class Variant:
    """One way of running the model: a callable on one input, and how it was made."""

    def __init__(self, name: str, run: Callable[[], Any], how: str) -> None:
        self.name, self.run, self.how = name, run, how


def _autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def _inductor_freezing(model: torch.nn.Module) -> Callable[[torch.Tensor], Any]:
    """The peer: ``torch.compile`` on the channels-last eval model, compiled and run with
    ``torch._inductor.config.freezing = True`` (patched for its calls only)."""
    import torch._inductor.config as inductor_config

    compiled = torch.compile(copy.deepcopy(model).to(memory_format=torch.channels_last))

    def run(inputs: torch.Tensor) -> Any:
        with inductor_config.patch(freezing=True):
            return compiled(inputs)

    return run


def build_variants(
    model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype, names: tuple[str, ...], workdir: Path
) -> tuple[list[Variant], dict[str, Any]]:
    """The variants of ``model`` on ``images`` in ``dtype``, and notes (fusion summary, skips,
    seconds to build and make the first call)."""
    device = images.device
    nhwc = images.to(memory_format=torch.channels_last)
    low = dtype != torch.float32
    autocast_how = f'autocast {dtype}'.replace('torch.', '') if low else 'float32'
    typed = str(dtype).replace('torch.', '')
    notes: dict[str, Any] = {'skipped': {}, 'first_call_seconds': {}}

    def under_autocast(module: Callable[[torch.Tensor], Any], inputs: torch.Tensor) -> Callable[[], Any]:
        def run():
            with _autocast(device, dtype):
                return module(inputs)

        return run

    def nchw() -> Variant:
        return Variant('nchw', under_autocast(model, images), f'eager, NCHW input, {autocast_how}')

    def channels_last() -> Variant:
        converted = copy.deepcopy(model).to(memory_format=torch.channels_last)
        return Variant(
            'channels_last', under_autocast(converted, nhwc), f'model.to(channels_last), NHWC input, {autocast_how}'
        )

    def composer() -> Variant:
        from composer.algorithms.channels_last import apply_channels_last as composer_channels_last

        converted = copy.deepcopy(model)
        composer_channels_last(converted)
        return Variant(
            'composer', under_autocast(converted, images), f"Composer's apply_channels_last, NCHW input, {autocast_how}"
        )

    def torchscript() -> Variant:
        scripted = torch.jit.script(copy.deepcopy(model).to(dtype))
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(scripted))
        inputs = images.to(dtype)
        return Variant('torchscript', lambda: frozen(inputs), f'script + freeze + optimize_for_inference, {typed}')

    def inductor() -> Variant:
        return Variant(
            'inductor',
            under_autocast(_inductor_freezing(model), nhwc),
            f'torch.compile(model.to(channels_last)), inductor freezing, NHWC input, {autocast_how}',
        )

    fused_copies: dict[str, Any] = {}

    def fused_eager() -> Any:
        if 'eager' not in fused_copies:
            fused_copies['eager'] = fuse_for_inference(model, images[:2])
            notes['fusion'] = str(fused_copies['eager'].summary)
        return fused_copies['eager']

    def fused() -> Variant:
        return Variant('fused', under_autocast(fused_eager(), nhwc), f'fuse_for_inference, NHWC input, {autocast_how}')

    def fused_copy() -> Variant:
        converted = copy.deepcopy(fused_eager()).to(dtype)
        inputs = nhwc.to(dtype)
        return Variant('fused (copy)', lambda: converted(inputs), f'fuse_for_inference(...).to({typed}), NHWC input')

    def fused_inductor() -> Variant:
        compiled = fuse_for_inference(model, images[:2], backend='inductor')  # checked in float32
        return Variant(
            'fused (inductor)',
            under_autocast(compiled, nhwc),
            f"fuse_for_inference(backend='inductor'), NHWC input, {autocast_how}",
        )

    def export() -> Variant:
        path = workdir / f'{type(model).__name__}.pt2'
        export_for_inference(model, path, images[:2])
        program = torch.export.load(path).module()
        return Variant('export', lambda: program(nhwc), 'torch.export.load(fused .pt2), NHWC input')

    builders = {
        'nchw': nchw,
        'channels_last': channels_last,
        'composer': composer,
        'torchscript': torchscript,
        'inductor': inductor,
        'fused': fused,
        'fused (copy)': fused_copy,
        'fused (inductor)': fused_inductor,
        'export': export,
    }
    reasons = {
        'composer': None if importlib.util.find_spec('composer') else 'Composer is not installed here',
        'fused (copy)': None if low else 'a converted copy is the float32 model itself',
        'export': 'the exported program is traced in float32 on CPU' if low or device.type != 'cpu' else None,
    }
    variants = []
    for name in names:
        if reasons.get(name):
            notes['skipped'][name] = reasons[name]
            continue
        start = time.perf_counter()
        try:
            variant = builders[name]()
            variant.run()
        except Exception as error:  # a variant this torch cannot build (a compiler failure, say) is reported
            notes['skipped'][name] = f'{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}'
            continue
        notes['first_call_seconds'][name] = time.perf_counter() - start
        variants.append(variant)
    return variants, notes


def _ratio_fields(timings: Any, reference: str, name: str, prefix: str) -> dict[str, Any]:
    if reference not in timings.seconds or not timings.seconds[reference] or not timings.seconds[name]:
        return {}
    ratio = timings.ratio(reference, name)
    return {f'{prefix}': ratio.median, f'{prefix}_interval': ratio.interval}


def measure(name: str, dtype_name: str, args: argparse.Namespace, workdir: Path) -> dict:
    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = DTYPES[dtype_name]
    torch.manual_seed(args.seed)
    model = build_model(name).eval().to(device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    with torch.inference_mode():
        variants, notes = build_variants(model, images, dtype, tuple(args.variants), workdir)
        baseline = next((v for v in variants if v.name == 'nchw'), variants[0])
        sync = synchronizer(device)
        one = time.perf_counter()
        baseline.run()
        if sync is not None:
            sync()
        iterations = args.iterations or max(1, math.ceil(args.min_seconds / (time.perf_counter() - one)))
        timings = time_interleaved(
            {v.name: v.run for v in variants},
            rounds=args.rounds,
            warmup=args.warmup,
            repeat=iterations,
            synchronize=sync,
            catch=True,
        )
    rows = []
    for variant in variants:
        own = timings.seconds[variant.name]
        if not own:
            notes['skipped'][variant.name] = timings.errors.get(variant.name, 'no timed round')
            continue
        rows.append(
            {
                'model': name,
                'dtype': dtype_name,
                'variant': variant.name,
                'how': variant.how,
                'seconds_per_batch': own,
                'best_images_per_s': args.batch_size / min(own),
                'median_images_per_s': args.batch_size / statistics.median(own),
                **_ratio_fields(timings, baseline.name, variant.name, 'speedup_vs_nchw'),
                **_ratio_fields(timings, 'inductor', variant.name, 'speedup_vs_inductor'),
            }
        )
    del variants, model
    gc.collect()
    return {
        'model': name,
        'dtype': dtype_name,
        'iterations': iterations,
        'rows': rows,
        'wall_seconds': time.perf_counter() - start,
        **notes,
    }


def parse_args(argv=None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split('\n\n', 1)[1],
    )
    parser.add_argument(
        '--models', nargs='+', default=list(MODELS), help='torchvision model names (default: %(default)s)'
    )
    parser.add_argument(
        '--dtypes',
        nargs='+',
        choices=sorted(DTYPES),
        default=['float32', 'float16'] if cuda else ['float32', 'bfloat16'],
        help='float32 and the reduced precision of the device (default: %(default)s)',
    )
    parser.add_argument('--variants', nargs='+', choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--image-size', type=int, default=224)
    parser.add_argument('--warmup', type=int, default=2, help='untimed rounds first (default 2)')
    parser.add_argument('--rounds', type=int, default=7, help='timed interleaved rounds (default 7)')
    parser.add_argument(
        '--iterations',
        type=int,
        help='calls per measurement (default: as many as make the NCHW model take --min-seconds)',
    )
    parser.add_argument('--min-seconds', type=float, default=0.3)
    parser.add_argument('--device', default='cuda' if cuda else 'cpu')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument(
        '--smoke',
        action='store_true',
        help='check that the script runs: '
        + ', '.join(f'{k}={v}' for k, v in SMOKE.items())
        + ' (timings meaningless; nothing is written unless --out is given)',
    )
    parser.add_argument('--out', type=Path, help='folder for inference-torch<X.Y>.json and .md (else print only)')
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


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
                    print(
                        f'{name:16} {dtype_name:9} {row["variant"]:17} best {row["best_images_per_s"]:7.1f} img/s  '
                        f'median {row["median_images_per_s"]:7.1f}  ({times(row, "speedup_vs_nchw")} NCHW, '
                        f'{times(row, "speedup_vs_inductor")} inductor)',
                        flush=True,
                    )
                for variant, why in group['skipped'].items():
                    print(f'{name:16} {dtype_name:9} {variant:17} not measured: {why}', flush=True)
                print(f'{name} {dtype_name}: {group["wall_seconds"]:.0f} s with building and warm-up', flush=True)
    result = {
        'command': ' '.join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        'machine': describe_machine(),
        'settings': {
            key: getattr(args, key)
            for key in (
                'batch_size',
                'image_size',
                'warmup',
                'rounds',
                'iterations',
                'min_seconds',
                'device',
                'seed',
                'smoke',
            )
        },
        'date': time.strftime('%Y-%m-%d'),
        'load_average_1min': {'before': load_before, 'after': os.getloadavg()[0]},
        'groups': groups,
    }
    for line in inductor_verdicts(groups, args.smoke):
        print(line)
    if args.out is not None:
        stem = 'inference-torch' + '.'.join(torch.__version__.split('+')[0].split('.')[:2])
        write_results(args.out, stem, result, markdown(result))
        print(f'wrote {args.out / stem}.json and .md')
    return 0


if __name__ == '__main__':
    sys.exit(main())
