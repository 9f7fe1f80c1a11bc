"""The one results writer of the benchmarks: the record every measuring script keeps of its run
(the benchmark, its command line, the machine with the torch version, the date, how long the run
took, the 1-minute load average in one shape) and the JSON + Markdown pair it writes.

The load average is always ``{'before': ..., 'after': ...}``, with ``'min'`` and ``'max'`` added
where the script sampled it while it ran; ``before`` is read when the run starts
(:meth:`RunStart.now`), ``after`` when its record is built.

Example:
    >>> import tempfile
    >>> start = RunStart.now()
    >>> record = run_record('demo', start, ['--rounds', '3'], machine={'pillow': '11'}, rows=[])
    >>> record['command'], record['machine']['pillow'], sorted(record['load_average_1min'])
    ('python benchmarks/demo.py --rounds 3', '11', ['after', 'before'])
    >>> [path.name for path in write_results(Path(tempfile.mkdtemp()) / 'cpu', 'demo', record, '# demo\\n')]
    ['demo.json', 'demo.md']
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional

from channels_last_algo.core.machine_description import describe_machine

__all__ = [
    'RESULTS',
    'RunStart',
    'finish',
    'main_over_models',
    'machine_lines',
    'machine_slug',
    'results_folder',
    'run_record',
    'write_results',
]

RESULTS = Path(__file__).resolve().parent / 'results'
"""The committed results, one folder per machine (:func:`machine_slug`)."""


@dataclasses.dataclass(frozen=True)
class RunStart:
    """When a run started: its clock (``time.perf_counter``) and the 1-minute load average then."""

    clock: float
    load_before: float

    @classmethod
    def now(cls) -> RunStart:
        return cls(time.perf_counter(), os.getloadavg()[0])


def machine_slug(info: dict[str, Any]) -> str:
    """A folder name for the machine's results: the GPU's name, or ``cpu-<usable cores>core``.

    Example:
        >>> machine_slug({'gpu': 'NVIDIA H100 80GB HBM3', 'cores_usable': 16})
        'nvidia-h100-80gb-hbm3'
        >>> machine_slug({'gpu': None, 'cores_usable': 2})
        'cpu-2core'
    """
    if info['gpu']:
        return re.sub(r'[^a-z0-9]+', '-', info['gpu'].lower()).strip('-')
    return f'cpu-{info["cores_usable"]}core'


def results_folder(out: Optional[Path], machine: dict[str, Any]) -> Path:
    """``out`` where given, else this machine's folder under :data:`RESULTS`."""
    return out or RESULTS / machine_slug(machine)


def _load_average(start: RunStart, during: Sequence[float]) -> dict[str, float]:
    load = {'before': start.load_before}
    if during:
        load.update(min=min(during), max=max(during))
    load['after'] = os.getloadavg()[0]
    return load


def run_record(
    benchmark: str,
    start: RunStart,
    argv: Optional[list[str]],
    machine: Optional[dict[str, Any]] = None,
    load_during: Sequence[float] = (),
    **fields: Any,
) -> dict[str, Any]:
    """What a run of ``benchmarks/<benchmark>.py`` records besides its results (``fields``): its
    command line (``argv``, or the process's when None), the machine (:func:`describe_machine`
    updated by ``machine``), the date, the seconds since ``start``, and the load average
    (``load_during``: samples taken while it ran, if any)."""
    arguments = sys.argv[1:] if argv is None else argv
    return {
        'benchmark': benchmark,
        'command': ' '.join(['python', f'benchmarks/{benchmark}.py', *arguments]),
        'machine': {**describe_machine(), **(machine or {})},
        'date': time.strftime('%Y-%m-%d'),
        'seconds': time.perf_counter() - start.clock,
        'load_average_1min': _load_average(start, load_during),
        **fields,
    }


def machine_lines(result: dict[str, Any]) -> list[str]:
    """The Markdown lines of a run's record that name its machine, torch, command and load average.

    Example:
        >>> record = {'machine': {'cpu': 'AMD EPYC', 'cores_usable': 2, 'torch_threads': 2, 'torch': '2.14.1',
        ...                       'torchvision': '0.29.1'}, 'command': 'python benchmarks/demo.py',
        ...           'load_average_1min': {'before': 0.5, 'after': 0.7}}
        >>> machine_lines(record)[2]
        '1-minute load average 0.5 before and 0.7 after.'
    """
    m, load = result['machine'], result['load_average_1min']
    return [
        f'Machine: {m["cpu"]}, {m["cores_usable"]} usable cores, {m["torch_threads"]} torch threads. '
        f'torch {m["torch"]}, torchvision {m["torchvision"]}. Command: `{result["command"]}`',
        '',
        f'1-minute load average {load["before"]:.1f} before and {load["after"]:.1f} after.',
    ]


def markdown_report(
    result: dict[str, Any], title: str, intro: str, columns: list[str], cells: Callable[[dict], list[str]]
) -> str:
    """A benchmark's Markdown: ``title``, its machine lines, ``intro``, and a table of ``columns`` (a name ending
    in ``:`` is right-aligned) with the cells ``cells(row)`` of each of the result's rows.

    Example:
        >>> record = {'machine': {'cpu': 'AMD EPYC', 'cores_usable': 2, 'torch_threads': 2, 'torch': '2.14.1',
        ...                       'torchvision': '0.29.1'}, 'command': 'python benchmarks/demo.py',
        ...           'load_average_1min': {'before': 0.5, 'after': 0.7}, 'rows': [{'model': 'm', 'ms': 1.5}]}
        >>> print(markdown_report(record, 'Demo', 'One row.', ['model', 'ms:'], lambda r: [r['model'], f"{r['ms']}"]))
        ... # doctest: +ELLIPSIS
        # Demo
        ...
        One row.
        <BLANKLINE>
        | model | ms |
        |---|---:|
        | m | 1.5 |
        <BLANKLINE>
    """
    header = '| ' + ' | '.join(column.rstrip(':') for column in columns) + ' |'
    rule = '|' + '|'.join('---:' if column.endswith(':') else '---' for column in columns) + '|'
    rows = ['| ' + ' | '.join(cells(row)) + ' |' for row in result['rows']]
    return '\n'.join([f'# {title}', '', *machine_lines(result), '', intro, '', header, rule, *rows]) + '\n'


def median_and_min(row: dict[str, Any], key: str, variant: str, digits: int = 1) -> str:
    """``'12.3 (11.9)'``: ``row[key + '_ms'][variant]`` and, in brackets, ``row[key + '_min_ms'][variant]``.

    Example:
        >>> median_and_min({'step_ms': {'a': 12.34}, 'step_min_ms': {'a': 11.9}}, 'step', 'a')
        '12.3 (11.9)'
    """
    return f'{row[f"{key}_ms"][variant]:.{digits}f} ({row[f"{key}_min_ms"][variant]:.{digits}f})'


def finish(benchmark: str, start: RunStart, argv: Optional[list[str]], args: Any, rows: list, markdown: Any) -> dict:
    """The end of a benchmark over models: its record (``args`` but ``--out`` and ``--models`` as its settings),
    ``markdown(record)`` printed, and both written under ``args.out`` where given; the record."""
    settings = {k: v for k, v in vars(args).items() if k not in ('out', 'models')}
    result = run_record(benchmark, start, argv, settings=settings, rows=rows)
    table = markdown(result)
    print(table)
    if args.out is not None:
        write_results(args.out, benchmark, result, table)
    return result


def main_over_models(
    benchmark: str,
    argv: Optional[list[str]],
    parse_args: Callable[[Optional[list[str]]], Any],
    measure: Callable[[str, Any], dict],
    line: Callable[[dict], str],
    markdown: Callable[[dict], str],
) -> int:
    """A benchmark's ``main`` over ``--models``: each one's row from ``measure(name, args)`` printed as ``line(row)``
    as it comes, then :func:`finish`; 0."""
    start = RunStart.now()
    args = parse_args(argv)
    rows = []
    for name in args.models:
        rows.append(measure(name, args))
        print(line(rows[-1]))
    finish(benchmark, start, argv, args, rows, markdown)
    return 0


def write_results(folder: Path, stem: str, result: dict[str, Any], markdown: str) -> tuple[Path, Path]:
    """Write ``result`` as ``<folder>/<stem>.json`` and its Markdown as ``<stem>.md``; both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = folder / f'{stem}.json', folder / f'{stem}.md'
    json_path.write_text(json.dumps(result, indent=2) + '\n')
    markdown_path.write_text(markdown)
    return json_path, markdown_path
