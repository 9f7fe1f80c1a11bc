"""Layout breaks of the timm zoo and the functional nets: plain channels last against the rules.

Each model (random weights, its zoo input, float32, training mode) is audited for one training
step (forward, a sum loss, backward) two ways:

    CL          model.to(memory_format=torch.channels_last) (Composer's ChannelsLast)
    rules       apply_channels_last(model): restrided weights, repair rules, kernel safe paths

and the report lists, per model, the breaks and the bytes they wrote in each, and the breaks left
by op and module. No timing: the counts do not depend on load.

Example:
    .venv-newest/bin/python benchmarks/zoo_breaks.py --out benchmarks/results/cpu-2core
"""

from __future__ import annotations

import argparse
import collections
import copy
import sys

import torch
import zoo_models as zoo  # benchmarks/, next to this script
from arguments import Option, benchmark_parser
from results_writer import RunStart, run_record, write_results

from channels_last_algo.core.audit_report import format_bytes
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.runtime import torch_release

MODELS = tuple(e.name for e in zoo.TIMM_ZOO + zoo.TIMM_HEAVY_ZOO) + tuple(
    e.name for e in zoo._functional().FUNCTIONAL_ZOO
)
WAYS = ('CL', 'rules')


def plain_channels_last(model: torch.nn.Module) -> tuple[torch.nn.Module | None, str | None]:
    """A copy of ``model`` after ``model.to(memory_format=torch.channels_last)``, or None and the error it
    raised (torch refuses the channels-last format for a 5D weight)."""
    try:
        return copy.deepcopy(model).to(memory_format=torch.channels_last), None
    except RuntimeError as error:
        return None, str(error)


def measure(name: str) -> dict:
    """The breaks of model ``name`` both ways."""
    entry = zoo.by_name(name)
    base = zoo.build(entry)
    x = torch.randn(*entry.input_shape, generator=torch.Generator().manual_seed(0))
    x = x.to(memory_format=torch.channels_last)
    ruled = copy.deepcopy(base)
    apply_channels_last(ruled)
    plain, cl_error = plain_channels_last(base)
    reports = {'rules': audit_model(ruled, x)}
    if plain is not None:
        reports['CL'] = audit_model(plain, x)
    left = collections.Counter(f'{b.op} {b.phase} in {b.where}' for b in reports['rules'].breaks)
    return {
        'model': name,
        'family': entry.family,
        'cl_error': cl_error,
        'breaks': {way: len(r.breaks) if (r := reports.get(way)) else None for way in WAYS},
        'break_bytes': {way: sum(b.nbytes for b in r.breaks) if (r := reports.get(way)) else None for way in WAYS},
        'left': dict(left),
    }


def _totals(rows: list[dict]) -> list[str]:
    cells = []
    for way in WAYS:
        ran = [row for row in rows if row['breaks'][way] is not None]
        broken = [row for row in ran if row['breaks'][way]]
        nbytes = sum(row['break_bytes'][way] for row in ran)
        failed = f', {len(rows) - len(ran)} failed' if len(ran) < len(rows) else ''
        count = sum(row['breaks'][way] for row in ran)
        cells.append(f'{count} in {len(broken)} models ({format_bytes(nbytes)}{failed})')
    return cells


def markdown(result: dict) -> str:
    m, rows = result['machine'], result['rows']
    lines = [
        '# Layout breaks of the zoo: plain channels last and the rules',
        '',
        f'torch {m["torch"]}, timm {m.get("timm") or "-"}, {m["cpu"]}. Command: `{result["command"]}`',
        '',
        'One float32 training step per model at its zoo input (timm nets 2 x 3 x 64 x 64; the functional nets '
        '16 or 32). Breaks: ops that took NHWC and wrote channels first, forward and backward (bytes they wrote). '
        '"fails": `model.to(memory_format=torch.channels_last)` raised (a 5D weight).',
        '',
        f'Totals over {len(rows)} models: ' + '; '.join(f'{w}: {c}' for w, c in zip(WAYS, _totals(rows))) + '.',
        '',
        '| model | family | CL | rules | breaks left (op, phase, module) |',
        '|---|---|---:|---:|---|',
    ]
    for row in rows:
        b, left = row['breaks'], '; '.join(f'{k} x{v}' for k, v in sorted(row['left'].items()))
        b = {**b, 'CL': 'fails' if b['CL'] is None else b['CL']}
        lines.append(f'| {row["model"]} | {row["family"]} | {b["CL"]} | {b["rules"]} | {left or "-"} |')
    return '\n'.join(lines) + '\n'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(
        __doc__,
        out='folder for zoo_breaks-torch<version>.json and .md',
        name=Option(f'zoo_breaks-torch{torch_release()}', 'results file stem'),
        epilog=False,
    )
    parser.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS, metavar='MODEL')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    start = RunStart.now()
    args = parse_args(argv)
    rows = []
    for name in args.models:
        rows.append(measure(name))
        print(f'{name:<32} {rows[-1]["breaks"]}', flush=True)
    result = run_record('zoo_breaks', start, argv, machine=zoo.library_versions(), rows=rows)
    table = markdown(result)
    print(table)
    if args.out is not None:
        write_results(args.out, args.name, result, table)
    return 0


if __name__ == '__main__':
    sys.exit(main())
