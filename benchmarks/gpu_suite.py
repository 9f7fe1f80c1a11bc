"""The GPU suite: one call on one CUDA device that runs the tests with a CUDA path and measures the speedups.

    ./run gpu                                   # one CUDA device, about 8 minutes at most; writes
                                                # benchmarks/results/<gpu>-torch<version>/
    ./run gpu --smoke --out DIR                 # the whole script on the CPU, small and short (its
                                                # compiled variants use dynamo's eager backend)

It needs torch, torchvision and pytest only (timm where installed; no Composer). Each part writes
``DIR/<part>.json`` and, after each, ``DIR/summary.md`` has the tables of all so far
(``benchmarks/gpu_report.py``); a part that fails records its error and the next one runs, and a part
that the time budget (``--budget``) no longer allows is recorded as skipped:

    machine     the GPU, driver, CUDA, cuDNN and torch versions
    tests       the tests with a CUDA path (marked ``cuda``: pytest -m cuda): summary line, exit code, each
                test's outcome and the failures' short tracebacks
    resnet50    ResNet-50 (the smoke run: ResNet-18) training steps in AMP (fp16, and bf16 where the device
                has it), batch 256 at 224 px (less on a device under 32 GiB), interleaved: NCHW,
                model.to(channels_last) (Composer's one line), this project (LayoutGuard), torch.compile
                NCHW, torch.compile + this project; median, 95% interval, images/s
    inference   fp16 inference of ResNet-50: NCHW eager, channels-last eager, this project's fused
                model, torch.compile of the channels-last model
    group_norm  one group norm, ReLU and convolution block of an NHWC activation in AMP, forward and
                backward, per form of group norm (benchmarks/group_norm_forms.py), at three ResNet stages
    zoo         AMP training steps of small nets and of nets with grouped convolutions or GroupNorm:
                NCHW, plain channels last, this project, auto mode's decision, and the audit's breaks
                on the device; last, so that the budget leaves out its last models rather than a part

Every timed comparison interleaves its variants round by round (channels_last_algo.core.timing), so
the device's clocks and other load touch all alike.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import group_norm_forms  # benchmarks/, next to this script
import torch
import torchvision
from gpu_report import timed_rows, write_summary  # benchmarks/, next to this script
from torch import nn

from channels_last_algo.core.fuse import fuse_for_inference
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.machine_description import describe_machine
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.runtime import torch_release
from channels_last_algo.core.timing import synchronizer, time_interleaved

ROOT = Path(__file__).resolve().parents[1]


def _group_norm_resnet18() -> nn.Module:
    return torchvision.models.resnet18(weights=None, norm_layer=lambda channels: nn.GroupNorm(32, channels))


ZOO: dict[str, Callable[[], nn.Module]] = {
    'mobilenet_v3_large': lambda: torchvision.models.mobilenet_v3_large(weights=None),
    'resnet18_groupnorm': _group_norm_resnet18,
    'efficientnet_b0': lambda: torchvision.models.efficientnet_b0(weights=None),
    'regnet_y_400mf': lambda: torchvision.models.regnet_y_400mf(weights=None),
    'resnext50_32x4d': lambda: torchvision.models.resnext50_32x4d(weights=None),
    'shufflenet_v2_x1_0': lambda: torchvision.models.shufflenet_v2_x1_0(weights=None),
}
PRECISIONS = {'fp16': torch.float16, 'bf16': torch.bfloat16}


def batch_for_memory(total: int) -> int:
    """ResNet-50's AMP training batch at 224 px for a device of ``total`` bytes: 256 where 32 GiB or more (AMP
    training at 256 takes about 22 GiB), halved while the memory is under 128 MiB an image, at least 32.

    Example:
        >>> [batch_for_memory(gib << 30) for gib in (141, 80, 40, 24, 16, 8)]
        [256, 256, 256, 128, 128, 64]
    """
    batch = 256
    while batch > 32 and total < batch * (128 << 20):
        batch //= 2
    return batch


class Settings:
    """Sizes and bounds: the GPU run's, or the CPU smoke run's."""

    def __init__(self, smoke: bool, budget: float) -> None:
        self.device = torch.device('cpu' if smoke else 'cuda')
        self.model = 'resnet18' if smoke else 'resnet50'  # the smoke run compiles a smaller net
        self.backend = 'eager' if smoke else 'inductor'  # the smoke run: dynamo's capture, no code generation
        self.batch, self.size = (4, 64) if smoke else (batch_for_memory(torch.cuda.mem_get_info()[1]), 224)
        self.zoo_batch, self.zoo_size = (2, 64) if smoke else (self.batch // 2, 224)
        self.rounds, self.warmup = (2, 1) if smoke else (10, 3)
        bf16 = smoke or torch.cuda.is_bf16_supported()  # not on a V100
        self.precisions = ('bf16',) if smoke else tuple(p for p in PRECISIONS if p != 'bf16' or bf16)
        self.zoo = tuple(ZOO)[:2] if smoke else tuple(ZOO)
        self.deadline = time.monotonic() + budget

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _training_step(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    dtype: torch.dtype,
    guard: Optional[LayoutGuard] = None,
) -> Callable:
    """One AMP training step (forward, loss, backward, SGD step) of ``model`` on a fixed batch; its
    forward and backward inside ``guard.step()`` where a guard is given."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler(images.device.type, enabled=dtype == torch.float16)

    def step() -> None:
        with guard.step() if guard is not None else contextlib.nullcontext():
            with torch.autocast(images.device.type, dtype=dtype):
                loss = nn.functional.cross_entropy(model(images), labels)
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def _variants(
    build: Callable[[], nn.Module], settings: Settings, compiled: bool
) -> dict[str, tuple[nn.Module, bool, Optional[LayoutGuard]]]:
    """The models to time, each with whether its batch goes NHWC and the guard whose steps it runs in
    (the compiled channels_last_algo variant: inductor's layout setting, core/compiled_backward.py)."""
    base = build().to(settings.device)
    plain = copy.deepcopy(base).to(memory_format=torch.channels_last)
    ours = copy.deepcopy(base)
    LayoutGuard().on_init(ours)
    variants = {
        'nchw': (base, False, None),
        'to_channels_last': (plain, True, None),
        'channels_last_algo': (ours, True, None),
    }
    if compiled:
        variants['compile_nchw'] = (torch.compile(copy.deepcopy(base), backend=settings.backend), False, None)
        guard, compiled_ours = LayoutGuard(), copy.deepcopy(base)
        guard.on_init(compiled_ours)
        variants['compile_channels_last_algo'] = (torch.compile(compiled_ours, backend=settings.backend), True, guard)
    return variants


def _time_training(
    build: Callable[[], nn.Module], settings: Settings, dtype: torch.dtype, batch: int, size: int, compiled: bool
) -> dict[str, Any]:
    images = torch.randn(batch, 3, size, size, device=settings.device)
    labels = torch.randint(0, 1000, (batch,), device=settings.device)
    steps, variants = {}, _variants(build, settings, compiled)
    for name, (model, nhwc, guard) in variants.items():
        inputs = images.contiguous(memory_format=torch.channels_last) if nhwc else images
        steps[name] = _training_step(model, inputs, labels, dtype, guard)
    timings = time_interleaved(
        steps,
        rounds=settings.rounds,
        warmup=settings.warmup,
        synchronize=synchronizer(settings.device),
        max_seconds=max(settings.left() / 2, 1.0),
        catch=True,
    )
    for _, _, guard in variants.values():
        if guard is not None:
            guard.close()
    return timed_rows(timings, batch, 'nchw')


def part_resnet50(settings: Settings) -> dict[str, Any]:
    build = lambda: getattr(torchvision.models, settings.model)(weights=None)  # noqa: E731
    return {
        precision: _time_training(build, settings, PRECISIONS[precision], settings.batch, settings.size, compiled=True)
        for precision in settings.precisions
    }


def part_zoo(settings: Settings) -> dict[str, Any]:
    results = {}
    for name in settings.zoo:
        if settings.left() < 30:
            results[name] = {'skipped': 'time budget spent'}
            continue
        build, start = ZOO[name], time.monotonic()
        result = _time_training(
            build, settings, PRECISIONS[settings.precisions[0]], settings.zoo_batch, settings.zoo_size, compiled=False
        )
        model = build().to(settings.device)
        guard = LayoutGuard(mode='auto')
        guard.on_init(model)
        x = torch.randn(settings.zoo_batch, 3, settings.zoo_size, settings.zoo_size, device=settings.device)
        labels = torch.randint(0, 1000, (settings.zoo_batch,), device=settings.device)
        loss = lambda m, b, labels=labels: nn.functional.cross_entropy(m(b), labels)  # noqa: E731
        decision = guard.auto.decide(model, x, loss, max_seconds=10)
        guard.close()
        audited = build().to(settings.device)
        LayoutGuard().on_init(audited)
        report = audit_model(audited, x.contiguous(memory_format=torch.channels_last))
        results[name] = result | {
            'auto_kept': decision.layout if decision is not None else f'on: {guard.auto.stood_down_because}',
            'breaks_after_rules': len(report.breaks),
            'breaks': sorted({f'{b.op} {b.phase} in {b.where}' for b in report.breaks}),
            'seconds': round(time.monotonic() - start, 1),
        }
    return results


def part_inference(settings: Settings) -> dict[str, Any]:
    dtype = PRECISIONS[settings.precisions[0]]
    base = getattr(torchvision.models, settings.model)(weights=None).eval().to(settings.device)
    x = torch.randn(settings.batch // 4 or 1, 3, settings.size, settings.size, device=settings.device)
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    plain = copy.deepcopy(base).to(memory_format=torch.channels_last)
    fused = fuse_for_inference(copy.deepcopy(base), x_nhwc)
    inductor = torch.compile(copy.deepcopy(plain), backend=settings.backend)

    def run(model: nn.Module, inputs: torch.Tensor) -> Callable[[], None]:
        def call() -> None:
            with torch.inference_mode(), torch.autocast(settings.device.type, dtype=dtype):
                model(inputs)

        return call

    calls = {
        'nchw': run(base, x),
        'channels_last': run(plain, x_nhwc),
        'fused': run(fused, x_nhwc),
        'compile_channels_last': run(inductor, x_nhwc),
    }
    timings = time_interleaved(
        calls, rounds=settings.rounds, warmup=settings.warmup, synchronize=synchronizer(settings.device), catch=True
    )
    return timed_rows(timings, x.shape[0], 'nchw')


def part_tests(settings: Settings) -> dict[str, Any]:
    """The tests marked ``cuda`` (``pytest -m cuda``), each with its outcome, also those done before a
    timeout stops the run; the smoke run collects the same, which skip there."""
    command = [sys.executable, '-m', 'pytest', '-v', '--tb=short', '-p', 'no:cacheprovider', '-m', 'cuda', 'tests']
    timeout = max(settings.left() / 2.5, 30.0)
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, exit_code = done.stdout, done.returncode
    except subprocess.TimeoutExpired as error:  # its output so far comes as bytes
        output, exit_code = (error.stdout or b'').decode(errors='replace'), None
    lines = output.strip().splitlines()
    outcomes = {}
    for line in lines:  # "tests/core/test_cuda.py::test_x PASSED  [ 12%]"
        test, _, rest = line.partition(' ')
        if '::' in test and rest.split(' ', 1)[0] in ('PASSED', 'FAILED', 'SKIPPED', 'ERROR', 'XFAIL', 'XPASS'):
            outcomes[test] = rest.split(' ', 1)[0]
    return {
        'command': ' '.join(command),
        'exit_code': exit_code,
        'summary': lines[-1].strip('= ') if exit_code is not None and lines else f'stopped after {timeout:.0f} s',
        'failed': [test for test, outcome in outcomes.items() if outcome in ('FAILED', 'ERROR')],
        'outcomes': outcomes,
        'failures': _failures(output) if exit_code != 0 else '',
    }


def _failures(output: str, limit: int = 40_000) -> str:
    """pytest's FAILURES and ERRORS sections (their short tracebacks) and its short summary; else the output's end."""
    section = re.search(r'^=+ (ERRORS|FAILURES) =+$', output, re.MULTILINE)
    return output[section.start() if section else 0 :][-limit:]


def part_machine(settings: Settings) -> dict[str, Any]:
    info = describe_machine()
    if settings.device.type == 'cuda':
        info |= {
            'gpu': torch.cuda.get_device_name(settings.device),
            'cuda': torch.version.cuda,
            'cudnn': torch.backends.cudnn.version(),
            'driver': _driver(),
        }
    return info | {'torch': torch.__version__, 'torchvision': torchvision.__version__}


def _driver() -> str:
    try:
        query = ['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader']
        return subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return 'unknown'


def part_group_norm(settings: Settings) -> dict[str, Any]:
    shapes = ((2, 64, 16, 16),) if settings.device.type == 'cpu' else group_norm_forms.SHAPES
    dtype = PRECISIONS[settings.precisions[0]]
    return group_norm_forms.time_forms(settings.device, dtype, shapes, settings.rounds, settings.warmup)


PARTS = {  # the zoo last: it leaves out the models the budget no longer allows, one by one
    'machine': part_machine,
    'tests': part_tests,
    'resnet50': part_resnet50,
    'inference': part_inference,
    'group_norm': part_group_norm,
    'zoo': part_zoo,
}


def run_part(name: str, settings: Settings, out: Path) -> dict[str, Any]:
    """Run one part and write its files; an error or a spent budget is the part's result."""
    start = time.monotonic()
    if name != 'machine' and settings.left() < 10:
        result: Any = {'skipped': 'time budget spent'}
    else:
        try:
            result = PARTS[name](settings)
        except Exception as error:  # noqa: BLE001  (recorded; the next part runs)
            result = {'error': f'{type(error).__name__}: {error}'}
    gc.collect()  # the part's models, guards and compiled graphs go now, not in the next part's timings
    if settings.device.type == 'cuda':
        torch.cuda.empty_cache()
    record = {'part': name, 'seconds': round(time.monotonic() - start, 1), 'result': result}
    (out / f'{name}.json').write_text(json.dumps(record, indent=2, default=str) + '\n')
    write_summary(out)
    print(f'gpu suite: {name} done in {record["seconds"]} s', flush=True)
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition('\n\n')[0])
    parser.add_argument(
        '--out', type=Path, default=None, help="folder for the parts' files (benchmarks/results/<gpu>-torch<version>/)"
    )
    parser.add_argument('--smoke', action='store_true', help='the whole script on the CPU, small and short')
    parser.add_argument('--budget', type=float, default=None, help='seconds for all parts (480; smoke: 240)')
    parser.add_argument('--parts', nargs='+', choices=tuple(PARTS), default=list(PARTS))
    args = parser.parse_args(argv)
    if args.smoke and args.out is None:
        parser.error('--smoke needs --out DIR: its numbers are a check of the script, not results to keep')
    if not args.smoke and not torch.cuda.is_available():
        parser.error('no CUDA device here; run with --smoke --out DIR to check the script on the CPU')
    return args


def results_folder(gpu: str, release: str) -> Path:
    """Where a GPU run's parts go by default: ``benchmarks/results/<gpu>-torch<release>/``.

    Example:
        >>> results_folder('NVIDIA H100 80GB HBM3', '2.11').name
        'nvidia-h100-80gb-hbm3-torch2.11'
    """
    slug = '-'.join(''.join(c if c.isalnum() else ' ' for c in gpu.lower()).split())
    return ROOT / 'benchmarks' / 'results' / f'{slug}-torch{release}'


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    settings = Settings(args.smoke, args.budget or (240.0 if args.smoke else 480.0))
    if settings.device.type == 'cuda':
        torch.backends.cudnn.benchmark = True
    if args.out is None:
        args.out = results_folder(torch.cuda.get_device_name(), torch_release())
    args.out.mkdir(parents=True, exist_ok=True)
    records = [run_part(name, settings, args.out) for name in args.parts]
    failed = [r['part'] for r in records if isinstance(r['result'], dict) and 'error' in r['result']]
    print(f'gpu suite: {len(records)} parts written to {args.out}' + (f'; failed: {failed}' if failed else ''))
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
