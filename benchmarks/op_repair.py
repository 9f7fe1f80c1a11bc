"""Training-step time of hybrid conv-attention nets with the op repair, against NCHW, plain channels
last and the package's rules alone; and what the op repair costs where it has nothing to repair.

Four variants of each hybrid model start from the same weights and train on the same batches:

    NCHW        the model as built, NCHW input
    CL          model.to(memory_format=torch.channels_last), NHWC input (Composer's ChannelsLast)
    rules       apply_channels_last(model), NHWC input: restrided weights and the repair rules
    op repair   the same, then the op repair as the layout guard puts it on after its first
                audited step: repair_ops from a float32 audit of one step, pruned after a second

The overhead part times ResNet-50 (no layout break after its rules, so the op repair installs
nothing in it) as ``rules`` against ``hooks present``: the same model while another model of the
process holds an op repair, so that the process-wide module hooks run at each of its module calls.
It also times one small op with and without a policy in force, the cost of the policy's look at an
op, which with the policy's op count per step gives the cost on a GPU on paper.

One training step is forward, cross entropy on random labels, backward, SGD step with momentum.
After warm-up, each round times one step of every variant in turn (``time_interleaved``), so that
load from other work slows them alike; min and median over rounds, and ratios as medians over rounds
of paired step times (above 1: the second variant is faster). A layout audit of one more step of
each variant counts its breaks (forward and backward).

Example:
    flock /tmp/channels_last_timing.lock .venv-newest/bin/python benchmarks/op_repair.py \\
        --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import zoo_models as zoo  # benchmarks/, next to this script
from arguments import Option, benchmark_parser
from results_writer import RunStart, run_record, write_results
from torch import nn
from torch.nn.modules import module as module_hooks

from channels_last_algo.core.audit import audit_model
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.op_policy import OpLayoutPolicy
from channels_last_algo.core.op_repair import prune_op_repairs, remove_op_repairs, repair_ops
from channels_last_algo.core.timing import time_interleaved

HYBRIDS = tuple(e.name for e in zoo.TIMM_ZOO + zoo.TIMM_HEAVY_ZOO if e.family == 'hybrid-conv-attention') + tuple(
    e.name for e in zoo._functional().FUNCTIONAL_ZOO
)
VARIANTS = ('NCHW', 'CL', 'rules', 'op repair')
OVERHEAD_VARIANTS = ('rules', 'hooks present')


def with_op_repair(model: nn.Module, x: torch.Tensor) -> list[str]:
    """Op repair of ``model`` as the guard places it: from an audit of one float32 step, pruned after a
    second; the paths of the modules that keep it."""
    found = audit_model(model, x)
    records = repair_ops(model, found)
    if not records:
        return []
    pruned = set(prune_op_repairs(model, audit_model(model, x), found))
    return [r.path for r in records if r.path not in pruned]


def plain_channels_last(model: nn.Module) -> tuple[nn.Module | None, str | None]:
    """A copy of ``model`` after ``model.to(memory_format=torch.channels_last)``, or None and the error it
    raised (torch refuses the channels-last format for a 5D weight)."""
    try:
        return copy.deepcopy(model).to(memory_format=torch.channels_last), None
    except RuntimeError as error:
        return None, str(error)


def variants(name: str, x: torch.Tensor) -> tuple[dict[str, nn.Module], list[str]]:
    """The four variants of model ``name``, and the modules that keep the op repair; ValueError where
    plain channels last fails on it."""
    base = zoo.build(zoo.by_name(name), num_classes=100)
    plain, error = plain_channels_last(base)
    if plain is None:
        raise ValueError(f'{name}: model.to(memory_format=torch.channels_last) fails ({error})')
    ruled = copy.deepcopy(base)
    apply_channels_last(ruled)
    repaired = copy.deepcopy(ruled)
    kept = with_op_repair(repaired, x.to(memory_format=torch.channels_last))
    return {'NCHW': base, 'CL': plain, 'rules': ruled, 'op repair': repaired}, kept


def make_step(model: nn.Module, images: torch.Tensor) -> Callable[[], None]:
    """One training step of ``model`` on a fixed batch, as a function."""
    target = torch.randint(0, 100, (images.shape[0],), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        nn.functional.cross_entropy(model(images), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def counted_calls(step: Callable[[], None]) -> dict[str, int]:
    """Module calls, and torch calls that went through an op layout policy, in one run of ``step``."""
    counts = {'module calls': 0, 'policy calls': 0}
    original = OpLayoutPolicy.__torch_function__

    def count_policy(self, *args, **kwargs):
        counts['policy calls'] += 1
        return original(self, *args, **kwargs)

    def count_module(module, args):
        counts['module calls'] += 1

    handle = module_hooks.register_module_forward_pre_hook(count_module)
    OpLayoutPolicy.__torch_function__ = count_policy
    try:
        step()
    finally:
        OpLayoutPolicy.__torch_function__ = original
        handle.remove()
    return counts


def _inputs(name: str, batch_size: int) -> torch.Tensor:
    _, channels, height, width = zoo.by_name(name).input_shape
    return torch.randn(batch_size, channels, height, width, generator=torch.Generator().manual_seed(0))


def _summary(timings, names: tuple[str, ...]) -> dict:
    seconds = timings.seconds
    return {
        'seconds': seconds,
        'min_ms': {v: 1e3 * min(seconds[v]) for v in names},
        'median_ms': {v: 1e3 * statistics.median(seconds[v]) for v in names},
    }


def measure(name: str, args: argparse.Namespace) -> dict:
    """Step times, breaks and policy work of the four variants of model ``name``."""
    x = _inputs(name, args.batch_size)
    models, kept = variants(name, x)
    steps = {v: make_step(models[v], x if v == 'NCHW' else x.to(memory_format=torch.channels_last)) for v in VARIANTS}
    timings = time_interleaved(steps, rounds=args.rounds, warmup=args.warmup)
    x_nhwc = x.to(memory_format=torch.channels_last)
    reports = {v: audit_model(models[v], x if v == 'NCHW' else x_nhwc) for v in VARIANTS}
    return {
        'model': name,
        **_summary(timings, VARIANTS),
        'op_repair_vs_cl': timings.ratio('CL', 'op repair').median,
        'op_repair_vs_rules': timings.ratio('rules', 'op repair').median,
        'op_repair_vs_nchw': timings.ratio('NCHW', 'op repair').median,
        'layout_breaks': {v: len(reports[v].breaks) for v in VARIANTS},
        'restore_bytes': reports['op repair'].fallback_bytes,
        'op_repaired_modules': kept,
        **counted_calls(steps['op repair']),
    }


def _bystander() -> tuple[nn.Module, object]:
    """A small model with layout breaks, and the audit that places an op repair on it: while it holds
    one, the process-wide module hooks are installed."""
    model = zoo.build(zoo.by_name('attention_reshape_net'))
    apply_channels_last(model)
    report = audit_model(model, _inputs('attention_reshape_net', 2).to(memory_format=torch.channels_last))
    if not report.breaks:
        raise RuntimeError('attention_reshape_net shows no break: the overhead variant would measure nothing')
    return model, report


def measure_overhead(args: argparse.Namespace) -> dict:
    """ResNet-50 with nothing to repair, with and without the op repair's module hooks in the process."""
    model = zoo.build(zoo.by_name('resnet50'), num_classes=100)
    apply_channels_last(model)
    x = torch.randn(args.batch_size, 3, args.resnet_size, args.resnet_size).to(memory_format=torch.channels_last)
    installed = repair_ops(model, audit_model(model, x))
    bystander, report = _bystander()
    step = make_step(model, x)

    def prepare(variant: str) -> None:  # untimed: the hooks in place for one variant, gone for the other
        remove_op_repairs(bystander)
        if variant == 'hooks present':
            repair_ops(bystander, report)

    timings = time_interleaved(
        {v: step for v in OVERHEAD_VARIANTS}, rounds=args.rounds, warmup=args.warmup, prepare=prepare
    )
    remove_op_repairs(bystander)
    return {
        'model': 'resnet50',
        'batch_size': args.batch_size,
        'image_size': args.resnet_size,
        'op_repairs_installed': len(installed),
        **_summary(timings, OVERHEAD_VARIANTS),
        'hooks_vs_none': timings.ratio('rules', 'hooks present').median,
        'hooks_vs_none_interval': timings.ratio('rules', 'hooks present').interval,
        'module_calls': counted_calls(step)['module calls'],
    }


def policy_look_us(calls: int = 20000) -> float:
    """Microseconds a policy in force adds to one op that it leaves as it is (an add of two small
    NHWC tensors): the median of 5 runs of ``calls`` adds with and without it."""
    a = torch.randn(1, 8, 4, 4).to(memory_format=torch.channels_last)
    b = torch.randn(1, 8, 4, 4).to(memory_format=torch.channels_last)

    def run(policy: bool) -> float:
        start = time.perf_counter()
        if policy:
            with OpLayoutPolicy('bench', found=()):
                for _ in range(calls):
                    torch.add(a, b)
        else:
            for _ in range(calls):
                torch.add(a, b)
        return time.perf_counter() - start

    with torch.no_grad():
        extra = [run(True) - run(False) for _ in range(5)]
    return 1e6 * statistics.median(extra) / calls


def module_hooks_us(calls: int = 20000) -> float:
    """Microseconds the op repair's process-wide module hooks add to one call of a module that holds no
    policy (an ``nn.Identity``): the median of 5 runs of ``calls`` calls with the hooks in place and without."""
    module, (bystander, report) = nn.Identity(), _bystander()
    x = torch.randn(1)

    def run(hooks: bool) -> float:
        remove_op_repairs(bystander)
        if hooks:
            repair_ops(bystander, report)
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        return time.perf_counter() - start

    extra = [run(True) - run(False) for _ in range(5)]
    remove_op_repairs(bystander)
    return 1e6 * statistics.median(extra) / calls


def _ms(row: dict, variants: tuple[str, ...]) -> list[str]:
    return [f'{row["median_ms"][v]:.1f} (min {row["min_ms"][v]:.1f})' for v in variants]


def markdown(result: dict) -> str:
    m, s, o = result['machine'], result['settings'], result['overhead']
    lines = [
        '# Op repair: training step time of hybrid nets, and its cost where nothing needs it',
        '',
        f'Machine: {m["cpu"]}, {m["cores_usable"]} usable cores ({m["cores"]} online), '
        f'{m["torch_threads"]} torch threads, GPU: {m["gpu"] or "none"}.',
        f'torch {m["torch"]}, torchvision {m["torchvision"]}, timm {m.get("timm") or "-"}, oneDNN {m["onednn"]}, '
        f'Python {m["python"]}.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after the run.',
        '',
        f"float32, batch {s['batch_size']} at each model's zoo input size (timm hybrids 64 x 64, the functional "
        f'nets 16 or 32), SGD with momentum; {s["rounds"]} timed steps per variant after {s["warmup"]} warm-up '
        'steps, interleaved. Medians (and minimums) in ms; ratios are medians over rounds of paired step times '
        '(above 1: op repair is faster). Breaks: layout breaks the audit finds in one training step. Where the '
        'op repair kept no module, "rules" and "op repair" run the same code and their ratio shows the noise.',
        '',
        '| model | NCHW | CL | rules | op repair | vs CL | vs rules | vs NCHW | breaks CL / rules / op repair | '
        'modules repaired | policy calls per step | restore copies (MB) |',
        '|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|',
    ]
    for row in result['rows']:
        b = row['layout_breaks']
        lines.append(
            f'| {row["model"]} | {" | ".join(_ms(row, VARIANTS))} | {row["op_repair_vs_cl"]:.2f}x | '
            f'{row["op_repair_vs_rules"]:.2f}x | {row["op_repair_vs_nchw"]:.2f}x | '
            f'{b["CL"]} / {b["rules"]} / {b["op repair"]} | {len(row["op_repaired_modules"])} | '
            f'{row["policy calls"]} | {row["restore_bytes"] / 2**20:.1f} |'
        )
    lines += [f'\nNot timed: {reason}.' for reason in result['skipped']]
    lines += overhead_lines(o, result['policy_look_us'], result['module_hooks_us'])
    return '\n'.join(lines) + '\n'


def overhead_lines(o: dict, look_us: float, hooks_us: float) -> list[str]:
    """The ResNet-50 part of the report, and the GPU case on paper."""
    low, high = o['hooks_vs_none_interval'] or (float('nan'), float('nan'))
    return [
        '',
        f'## Where nothing needs it: ResNet-50, batch {o["batch_size"]} x 3 x {o["image_size"]} x {o["image_size"]}',
        '',
        f'The op repair installed {o["op_repairs_installed"]} policies in ResNet-50 (no break after the rules): '
        'its step runs no code of the op repair. When another model of the process holds one, the process-wide '
        f'module hooks run at each of its {o["module_calls"]} module calls per step:',
        '',
        '| variant | median ms | min ms |',
        '|---|---:|---:|',
        *[f'| {v} | {o["median_ms"][v]:.1f} | {o["min_ms"][v]:.1f} |' for v in OVERHEAD_VARIANTS],
        '',
        f'hooks present vs none: {o["hooks_vs_none"]:.3f}x, 95% interval [{low:.3f}, {high:.3f}] (median of paired '
        'rounds; above 1: faster with the hooks). Where the interval holds 1, the hooks cost less than the '
        f"run's noise. Timed alone, the hooks add {hooks_us:.2f} us to a module call (the median of 5 x 20000 calls "
        f'of an nn.Identity with and without them): {hooks_us * o["module_calls"] / 1e3:.2f} ms per step here, '
        f'{100 * hooks_us * o["module_calls"] / 1e3 / o["median_ms"]["rules"]:.3f}% of the step.',
        '',
        f'A policy in force adds {look_us:.1f} us to an op it leaves as it is (the median of 5 x 20000 small adds '
        'with and without it). On a GPU that cost is on the host thread, which runs ahead of the kernels: a '
        'step pays it only where the host, not the device, is the limit. The table gives the policy calls per '
        "step of each hybrid net; their product with this figure is what the policy's look costs the host. The "
        'copies (the restore column) and the Python gradient hooks on the ops it sees come on top.',
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__, warmup=Option(2), rounds=Option(9), out='folder for op_repair.json and op_repair.md', epilog=False
    )
    parser.add_argument('--models', nargs='+', default=list(HYBRIDS), choices=HYBRIDS, metavar='MODEL')
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--resnet-size', type=int, default=128, help='ResNet-50 image size (default 128)')
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.batch_size < 2 or args.resnet_size < 32:
        parser.error(
            'need --rounds >= 1, --warmup >= 0, --batch-size >= 2 (BatchNorm in training), --resnet-size >= 32'
        )
    return args


def main(argv: list[str] | None = None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    rows, skipped = [], []
    for name in args.models:
        try:
            rows.append(measure(name, args))
        except ValueError as error:  # no CL variant to compare with
            skipped.append(str(error))
            print(f'skipped {error}', flush=True)
            continue
        row = rows[-1]
        print(f'{name:<32} ' + '  '.join(f'{v} {row["median_ms"][v]:7.1f} ms' for v in VARIANTS), flush=True)
    overhead = measure_overhead(args)
    settings = {k: v for k, v in vars(args).items() if k not in ('out', 'models')}
    result = run_record(
        'op_repair',
        start,
        argv,
        zoo.library_versions(),
        settings=settings,
        rows=rows,
        skipped=skipped,
        overhead=overhead,
        policy_look_us=policy_look_us(),
        module_hooks_us=module_hooks_us(),
    )
    table = markdown(result)
    print(table)
    if args.out is not None:
        write_results(args.out, 'op_repair', result, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
