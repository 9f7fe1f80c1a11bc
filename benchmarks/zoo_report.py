"""The report of ``benchmarks/zoo.py``: each model's paired speedups with their verdicts, auto
mode's agreement with the faster format, the geometric means, the findings, and the Markdown; and the
rows of the benchmarks that time variants of each model interleaved (``compile.py``, ``lightning_fit.py``).

Example:
    >>> row = {'seconds': {'nchw': [2.0] * 6, 'ours': [1.0] * 6, 'auto': [1.0] * 6}, 'errors': {},
    ...        'auto': {'layout': 'channels last'}}
    >>> row = summarise(row)
    >>> row['ratios']['ours_vs_nchw']['verdict'], row['faster_layout'], row['auto']['agrees']
    ('faster', 'channels last', True)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Optional

import torch
from zoo_models import by_name

from channels_last_algo.core.layout import MemoryFormat
from channels_last_algo.core.machine_description import machine_label
from channels_last_algo.core.timing import Ratio, Timings

__all__ = [
    'MARGIN',
    'VARIANTS',
    'cell',
    'findings',
    'geometric_means',
    'markdown',
    'measure_each',
    'summarise',
    'timed_row',
]

VARIANTS = ('nchw', 'composer', 'ours', 'auto')
MARGIN = 0.02  # the tie band, as auto mode's default
COMPARISONS = (('nchw', 'composer'), ('nchw', 'ours'), ('nchw', 'auto'), ('composer', 'ours'), ('ours', 'auto'))


def summarise(row: dict) -> dict:
    """Add medians, paired speedups with their intervals and verdicts, and auto's agreement."""
    seconds = row['seconds']
    ran = [name for name in VARIANTS if seconds.get(name)]
    row['median_ms'] = {name: 1e3 * statistics.median(seconds[name]) for name in ran}
    row['ratios'] = {}
    for reference, other in COMPARISONS:
        if reference in ran and other in ran and len(seconds[reference]) == len(seconds[other]):
            ratio = Ratio.of([r / o for r, o in zip(seconds[reference], seconds[other])])
            row['ratios'][f'{other}_vs_{reference}'] = {
                'median': ratio.median,
                'noise': ratio.noise,
                'interval': ratio.interval,
                'verdict': ratio.verdict(MARGIN),
            }
    ours = row['ratios'].get('ours_vs_nchw')
    layouts = {'faster': str(MemoryFormat.CHANNELS_LAST), 'slower': str(MemoryFormat.CHANNELS_FIRST)}
    row['faster_layout'] = None if ours is None else layouts.get(ours['verdict'], 'no difference')
    auto = row['auto']
    if auto is not None:
        clear = row['faster_layout'] in layouts.values()
        auto['agrees'] = auto['layout'] == row['faster_layout'] if clear else None
        if auto['agrees'] is False:  # what the other choice cost: auto's steps against the faster variant's
            faster_variant = 'ours' if row['faster_layout'] == layouts['faster'] else 'nchw'
            auto['against_faster'] = row['ratios'].get(f'auto_vs_{faster_variant}')
    return row


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float('nan')


def geometric_means(rows: list[dict], names: tuple[str, ...]) -> dict:
    """Over the models where every variant ran: geometric mean step time and speedup over NCHW."""
    complete = [row for row in rows if all(name in row['median_ms'] for name in names)]
    means = {'models': len(complete), 'median_ms': {}, 'speedup_vs_nchw': {}}
    for name in names:
        means['median_ms'][name] = _geomean([row['median_ms'][name] for row in complete])
        means['speedup_vs_nchw'][name] = (
            1.0 if name == 'nchw' else _geomean([row['ratios'][f'{name}_vs_nchw']['median'] for row in complete])
        )
    return means


def cell(ratio: Optional[dict]) -> str:
    """A speedup cell: the median ratio, its interval, and + or - where it is beyond the tie band."""
    if ratio is None:
        return ''
    interval = '' if ratio['interval'] is None else f' [{ratio["interval"][0]:.2f}, {ratio["interval"][1]:.2f}]'
    mark = {'faster': ' +', 'slower': ' **-**'}.get(ratio['verdict'], '')
    return f'{ratio["median"]:.2f}x{interval}{mark}'


def timed_row(model: str, timings: Timings, steps_per_call: int = 1) -> dict:
    """A model's row from :func:`~channels_last_algo.core.timing.time_interleaved`: each variant's min and
    median ms per step (a call ran ``steps_per_call`` steps), its speedup over ``nchw`` with interval and
    verdict, the fastest variant, and the errors.

    Example:
        >>> row = timed_row('m', Timings({'nchw': [2.0] * 6, 'ours': [1.0] * 6}, {}, 1, 1, 'rounds'))
        >>> row['ms']['ours'], row['ratios']['ours']['verdict'], row['fastest']
        ({'min': 1000.0, 'median': 1000.0}, 'faster', 'ours')
    """
    row = {'model': model, 'errors': dict(timings.errors), 'ms': {}, 'ratios': {}}
    for name, seconds in timings.seconds.items():
        per_step = [1e3 * s / steps_per_call for s in seconds]
        row['ms'][name] = {'min': min(per_step), 'median': statistics.median(per_step)}
        if name != 'nchw' and 'nchw' in timings.seconds:
            ratio = timings.ratio('nchw', name)
            row['ratios'][name] = {'median': ratio.median, 'interval': ratio.interval, 'verdict': ratio.verdict(MARGIN)}
    row['fastest'] = min(row['ms'], key=lambda n: row['ms'][n]['median']) if row['ms'] else None
    return row


def measure_each(models: list[str], threads: int, measure: Callable[[str], dict]) -> list[dict]:
    """``measure(model)`` of each zoo model on ``threads`` torch threads, each row's speedups printed as it
    comes; an unknown name raises (naming the zoo) before anything runs."""
    for name in models:
        by_name(name)
    torch.set_num_threads(threads)
    rows = []
    for name in models:
        rows.append(measure(name))
        print(rows[-1]['model'], {k: cell(v) for k, v in rows[-1]['ratios'].items()}, rows[-1]['errors'], flush=True)
    return rows


def _load_meaning(most: float, threads: int, machine: dict) -> str:
    """What the load while the models ran says of the step times: above the benchmark's own threads (and
    half a thread of slack), other work shared the cores."""
    if most > threads + 0.5:
        return f'other work shared the {machine["cores_usable"]} cores, so every step time is noisy'
    return 'no other work ran beside the benchmark'


def _header(result: dict) -> list[str]:
    """The title, the machine, the command, the load while the models ran, and how to read the cells."""
    s = result['settings']
    load = result['load_average_1min']
    return [
        f"# Zoo: training step time, NCHW / Composer's ChannelsLast / this project / auto mode: "
        f'{machine_label(result["machine"])}',
        '',
        f'{result["machine"]["cpu"]}, {result["machine"]["cores_usable"]} usable cores, torch '
        f'{result["machine"]["torch"]}, torchvision {result["machine"]["torchvision"]}, timm {result["timm"]}, '
        f'Composer {result["composer"] or "not installed"}. {result["date"]}, {result["seconds"] / 60:.0f} minutes.',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'1-minute load average {load["before"]:.1f} before, {load["min"]:.1f} to {load["max"]:.1f} while the '
        f'models ran, {load["after"]:.1f} after: {_load_meaning(load["max"], s["threads"], result["machine"])}; '
        'the variants of a model run interleaved round by round, so the ratios are fairer than the times.',
        '',
        f"Batch {s['batch_size']} at each model's zoo input size, float32, {s['threads']} torch thread(s), SGD with "
        f'momentum; {s["rounds"]} timed '
        f'rounds after {s["warmup"]} warm-up round(s), one step of each variant a round, in rotated order. Speedup '
        'cells: median of the per-round ratios over NCHW (or Composer) and its 95% interval; **+** / **-**: '
        f'faster / slower beyond noise (the interval outside [1/{1 + MARGIN:g}, {1 + MARGIN:g}]). Auto: '
        f'decide_layout on the same batch, at most {s["auto_seconds"]} s; "tie" keeps channels last, the default. '
        '"faster layout": ours against NCHW beyond noise ("no difference": the interval is not outside the band); '
        'where auto chose the other, "auto agrees" gives its steps against the faster variant\'s. Auto times the '
        'model as it was (its swaps taken back) in NCHW against the converted model in channels last, as ours '
        'against NCHW compares them.',
        '',
    ]


def _means(result: dict) -> list[str]:
    """The geometric means table and the findings."""
    means, names = result['geometric_means'], tuple(result['variants'])
    return [
        f'## Geometric means over the {means["models"]} models where every variant ran',
        '',
        '| | ' + ' | '.join(names) + ' |',
        '|---|' + '---:|' * len(names),
        '| step time (ms) | ' + ' | '.join(f'{means["median_ms"][n]:.1f}' for n in names) + ' |',
        '| speedup over NCHW | ' + ' | '.join(f'{means["speedup_vs_nchw"][n]:.2f}x' for n in names) + ' |',
        '',
        *[f'- {line}' for line in result['findings']],
    ]


def _auto_cells(auto: Optional[dict]) -> tuple[str, str]:
    """What auto mode kept, and whether that agrees with the faster layout (what it cost where not)."""
    if auto is None:
        return '', ''
    kept = f'{auto["layout"]}{" (tie)" if auto["tie"] else ""}, {auto["speedup"]:.2f}x in {auto["rounds"]} rounds'
    agrees = '' if auto['agrees'] is None else 'yes'
    if auto['agrees'] is False:
        agrees = f'**no**: auto {cell(auto["against_faster"])} of the faster'
    return kept, agrees


def _model_row(row: dict) -> str:
    kept, agrees = _auto_cells(row['auto'])
    nchw = row['median_ms'].get('nchw')
    errors = '; '.join(f'{name}: {error}' for name, error in row['errors'].items())
    return (
        f'| {row["model"]} | {row["source"]} | {row["family"]} | {"x".join(map(str, row["input_shape"][-2:]))} | '
        f'{"" if nchw is None else f"{nchw:.1f}"} | {cell(row["ratios"].get("composer_vs_nchw"))} | '
        f'{cell(row["ratios"].get("ours_vs_nchw"))} | {cell(row["ratios"].get("auto_vs_nchw"))} | '
        f'{cell(row["ratios"].get("ours_vs_composer"))} | {kept} | {row["faster_layout"] or ""} | '
        f'{agrees} | {errors} |'
    )


def markdown(result: dict) -> str:
    per_model = [
        '',
        '## Per model',
        '',
        '| model | source | family | input | NCHW ms | Composer | ours | auto | ours vs Composer | auto kept | '
        'faster layout | auto agrees | errors |',
        '|---|---|---|---|---:|---:|---:|---:|---:|---|---|---|---|',
        *map(_model_row, result['rows']),
    ]
    return '\n'.join([*_header(result), *_means(result), *per_model]) + '\n'


def findings(rows: list[dict]) -> list[str]:
    """The issue's checks, each as one line naming the models."""

    def models(test: Callable[[dict], bool]) -> str:
        found = [row['model'] for row in rows if test(row)]
        return ', '.join(found) if found else 'none'

    def slower(key: str) -> Callable[[dict], bool]:
        return lambda row: row['ratios'].get(key, {}).get('verdict') == 'slower'

    disagrees = lambda row: row['auto'] is not None and row['auto']['agrees'] is False
    costly = lambda row: disagrees(row) and (row['auto']['against_faster'] or {}).get('verdict') == 'slower'
    return [
        f"this project slower than Composer's ChannelsLast beyond noise: {models(slower('ours_vs_composer'))}",
        f'auto mode slower than NCHW beyond noise: {models(slower("auto_vs_nchw"))}',
        f"auto's choice differs from the faster layout: {models(disagrees)}; of these, auto slower than the faster "
        f'variant beyond noise: {models(costly)}',
        f'crashed or failed: {models(lambda row: bool(row["errors"]))}',
    ]
