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
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch
from arguments import Option, benchmark_parser  # benchmarks/, next to this script
from inference_report import inductor_verdicts, markdown, times
from results_writer import RunStart, run_record, write_results

from channels_last_algo.app.recipes.models import build_model
from channels_last_algo.core.fuse import export_for_inference, fuse_for_inference
from channels_last_algo.core.runtime import torch_release
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
SETTINGS = ('batch_size', 'image_size', 'warmup', 'rounds', 'iterations', 'min_seconds', 'device', 'seed', 'smoke')
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


class VariantBuilder:
    """Builds each variant of one model on one batch in one dtype; ``notes`` collects the fusion
    summary, the variants skipped and why, and the seconds to build each and make its first call."""

    def __init__(self, model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype, workdir: Path) -> None:
        self.model, self.images, self.dtype, self.workdir = model, images, dtype, workdir
        self.device = images.device
        self.nhwc = images.to(memory_format=torch.channels_last)
        self.low = dtype != torch.float32
        self.autocast_how = f'autocast {dtype}'.replace('torch.', '') if self.low else 'float32'
        self.typed = str(dtype).replace('torch.', '')
        self.notes: dict[str, Any] = {'skipped': {}, 'first_call_seconds': {}}
        self._fused: Any = None

    def under_autocast(self, module: Callable[[torch.Tensor], Any], inputs: torch.Tensor) -> Callable[[], Any]:
        def run():
            with _autocast(self.device, self.dtype):
                return module(inputs)

        return run

    def nchw(self) -> Variant:
        return Variant('nchw', self.under_autocast(self.model, self.images), f'eager, NCHW input, {self.autocast_how}')

    def channels_last(self) -> Variant:
        converted = copy.deepcopy(self.model).to(memory_format=torch.channels_last)
        how = f'model.to(channels_last), NHWC input, {self.autocast_how}'
        return Variant('channels_last', self.under_autocast(converted, self.nhwc), how)

    def composer(self) -> Variant:
        from composer.algorithms.channels_last import apply_channels_last as composer_channels_last

        converted = copy.deepcopy(self.model)
        composer_channels_last(converted)
        how = f"Composer's apply_channels_last, NCHW input, {self.autocast_how}"
        return Variant('composer', self.under_autocast(converted, self.images), how)

    def torchscript(self) -> Variant:
        scripted = torch.jit.script(copy.deepcopy(self.model).to(self.dtype))
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(scripted))
        inputs = self.images.to(self.dtype)
        how = f'script + freeze + optimize_for_inference, {self.typed}'
        return Variant('torchscript', lambda: frozen(inputs), how)

    def inductor(self) -> Variant:
        how = f'torch.compile(model.to(channels_last)), inductor freezing, NHWC input, {self.autocast_how}'
        return Variant('inductor', self.under_autocast(_inductor_freezing(self.model), self.nhwc), how)

    def fused_eager(self) -> Any:
        """The eager fused copy, built once for the variants that share it."""
        if self._fused is None:
            self._fused = fuse_for_inference(self.model, self.images[:2])
            self.notes['fusion'] = str(self._fused.summary)
        return self._fused

    def fused(self) -> Variant:
        how = f'fuse_for_inference, NHWC input, {self.autocast_how}'
        return Variant('fused', self.under_autocast(self.fused_eager(), self.nhwc), how)

    def fused_copy(self) -> Variant:
        converted = copy.deepcopy(self.fused_eager()).to(self.dtype)
        inputs = self.nhwc.to(self.dtype)
        how = f'fuse_for_inference(...).to({self.typed}), NHWC input'
        return Variant('fused (copy)', lambda: converted(inputs), how)

    def fused_inductor(self) -> Variant:
        compiled = fuse_for_inference(self.model, self.images[:2], backend='inductor')  # checked in float32
        how = f"fuse_for_inference(backend='inductor'), NHWC input, {self.autocast_how}"
        return Variant('fused (inductor)', self.under_autocast(compiled, self.nhwc), how)

    def export(self) -> Variant:
        path = self.workdir / f'{type(self.model).__name__}.pt2'
        export_for_inference(self.model, path, self.images[:2])
        program = torch.export.load(path).module()
        nhwc = self.nhwc
        return Variant('export', lambda: program(nhwc), 'torch.export.load(fused .pt2), NHWC input')

    def skip_reason(self, name: str) -> Optional[str]:
        """Why variant ``name`` is not built for this dtype and device, or None."""
        if name == 'composer' and not importlib.util.find_spec('composer'):
            return 'Composer is not installed here'
        if name == 'fused (copy)' and not self.low:
            return 'a converted copy is the float32 model itself'
        if name == 'export' and (self.low or self.device.type != 'cpu'):
            return 'the exported program is traced in float32 on CPU'
        return None

    def build(self, name: str) -> Optional[Variant]:
        """Variant ``name``, built and called once (compiling, if it compiles); None, with the
        reason in the notes, where it is skipped or this torch cannot build it."""
        reason = self.skip_reason(name)
        if reason:
            self.notes['skipped'][name] = reason
            return None
        start = time.perf_counter()
        try:
            variant = BUILDERS[name](self)
            variant.run()
        except Exception as error:  # a variant this torch cannot build (a compiler failure, say) is reported
            self.notes['skipped'][name] = f'{type(error).__name__}: {str(error).strip().splitlines()[0][:200]}'
            return None
        self.notes['first_call_seconds'][name] = time.perf_counter() - start
        return variant


BUILDERS: dict[str, Callable[[VariantBuilder], Variant]] = {
    'nchw': VariantBuilder.nchw,
    'channels_last': VariantBuilder.channels_last,
    'composer': VariantBuilder.composer,
    'torchscript': VariantBuilder.torchscript,
    'inductor': VariantBuilder.inductor,
    'fused': VariantBuilder.fused,
    'fused (copy)': VariantBuilder.fused_copy,
    'fused (inductor)': VariantBuilder.fused_inductor,
    'export': VariantBuilder.export,
}
"""The :class:`VariantBuilder` method that builds each of :data:`VARIANTS`."""


def build_variants(
    model: torch.nn.Module, images: torch.Tensor, dtype: torch.dtype, names: tuple[str, ...], workdir: Path
) -> tuple[list[Variant], dict[str, Any]]:
    """The variants of ``model`` on ``images`` in ``dtype``, and notes (fusion summary, skips,
    seconds to build and make the first call)."""
    builder = VariantBuilder(model, images, dtype, workdir)
    variants = [builder.build(name) for name in names]
    return [variant for variant in variants if variant is not None], builder.notes


def _ratio_fields(timings: Any, reference: str, name: str, prefix: str) -> dict[str, Any]:
    if reference not in timings.seconds or not timings.seconds[reference] or not timings.seconds[name]:
        return {}
    ratio = timings.ratio(reference, name)
    return {f'{prefix}': ratio.median, f'{prefix}_interval': ratio.interval}


def calls_per_measurement(baseline: Variant, sync: Optional[Callable[[], None]], args: argparse.Namespace) -> int:
    """--iterations, or as many calls as make the baseline take --min-seconds, from one timed call."""
    one = time.perf_counter()
    baseline.run()
    if sync is not None:
        sync()
    return args.iterations or max(1, math.ceil(args.min_seconds / (time.perf_counter() - one)))


def group_rows(
    model: str, dtype_name: str, variants: list[Variant], timings: Any, baseline: str, batch_size: int, skipped: dict
) -> list[dict]:
    """A row per variant timed; a variant without a timed round goes to ``skipped`` with its error."""
    rows = []
    for variant in variants:
        own = timings.seconds[variant.name]
        if not own:
            skipped[variant.name] = timings.errors.get(variant.name, 'no timed round')
            continue
        rows.append(
            {
                'model': model,
                'dtype': dtype_name,
                'variant': variant.name,
                'how': variant.how,
                'seconds_per_batch': own,
                'best_images_per_s': batch_size / min(own),
                'median_images_per_s': batch_size / statistics.median(own),
                **_ratio_fields(timings, baseline, variant.name, 'speedup_vs_nchw'),
                **_ratio_fields(timings, 'inductor', variant.name, 'speedup_vs_inductor'),
            }
        )
    return rows


def measure(name: str, dtype_name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """One (model, dtype) group: its variants built, timed interleaved, and their rows."""
    start = time.perf_counter()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = build_model(name).eval().to(device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    with torch.inference_mode():
        variants, notes = build_variants(model, images, DTYPES[dtype_name], tuple(args.variants), workdir)
        baseline = next((v for v in variants if v.name == 'nchw'), variants[0])
        sync = synchronizer(device)
        iterations = calls_per_measurement(baseline, sync, args)
        timings = time_interleaved(
            {v.name: v.run for v in variants},
            rounds=args.rounds,
            warmup=args.warmup,
            repeat=iterations,
            synchronize=sync,
            catch=True,
        )
    rows = group_rows(name, dtype_name, variants, timings, baseline.name, args.batch_size, notes['skipped'])
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
    parser = benchmark_parser(
        __doc__,
        warmup=Option(2, 'untimed rounds first (default 2)'),
        rounds=Option(7, 'timed interleaved rounds (default 7)'),
        out='folder for inference-torch<X.Y>.json and .md (else print only)',
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
    parser.add_argument(
        '--iterations',
        type=int,
        help='calls per measurement (default: as many as make the NCHW model take --min-seconds)',
    )
    parser.add_argument('--min-seconds', type=float, default=0.3)
    parser.add_argument('--device', default='cuda' if cuda else 'cpu')
    parser.add_argument('--seed', type=int, default=0)
    smoke = ', '.join(f'{k}={v}' for k, v in SMOKE.items())
    parser.add_argument(
        '--smoke',
        action='store_true',
        help=f'check that the script runs: {smoke} (timings meaningless; nothing is written unless --out is given)',
    )
    args = parser.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def print_group(group: dict) -> None:
    """Each measured variant's throughput, each variant not measured and why, and the group's time."""
    name, dtype_name = group['model'], group['dtype']
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


def main(argv=None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    groups = []
    with tempfile.TemporaryDirectory(prefix='inference-bench-') as tmp:
        for name in args.models:
            for dtype_name in args.dtypes:
                groups.append(measure(name, dtype_name, args, Path(tmp)))
                print_group(groups[-1])
    settings = {key: getattr(args, key) for key in SETTINGS}
    result = run_record('inference', start, argv, settings=settings, groups=groups)
    for line in inductor_verdicts(groups, args.smoke):
        print(line)
    if args.out is not None:
        stem = 'inference-torch' + torch_release()
        write_results(args.out, stem, result, markdown(result))
        print(f'wrote {args.out / stem}.json and .md')
    return 0


if __name__ == '__main__':
    sys.exit(main())
