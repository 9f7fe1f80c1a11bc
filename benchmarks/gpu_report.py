"""The GPU suite's summary: one Markdown page of the parts' results (``benchmarks/gpu_suite.py``), tables
of speedups over NCHW with their 95% intervals, the tests' outcome and the audit's breaks per model.

    python benchmarks/gpu_report.py DIR     # (re)writes DIR/summary.md from the DIR/<part>.json files

Example:
    >>> speedup_cell({'median_ms': 45.2, 'speedup_vs_nchw': 1.9, 'interval': [1.67, 1.94]})
    '1.90x (1.67-1.94)'
    >>> speedup_cell({'median_ms': 86.2, 'speedup_vs_nchw': None, 'interval': None})
    '1.00x'
    >>> speedup_cell({'median_ms': 50.0, 'speedup_vs_nchw': 1.7, 'interval': None})  # too few rounds for one
    '1.70x'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the summary itself needs no torch: it renders on any machine
    from channels_last_algo.core.timing import Timings

__all__ = ['PART_ORDER', 'speedup_cell', 'summary', 'timed_rows', 'write_summary']

PART_ORDER = ('machine', 'tests', 'resnet50', 'inference', 'group_norm', 'zoo')


def timed_rows(timings: Timings, images: int, reference: str) -> dict[str, Any]:
    """Per variant: median and min ms, images/s, and the median ratio to ``reference`` with its interval."""
    rows = {}
    for name, seconds in timings.seconds.items():
        if not seconds:
            continue
        ratio = timings.ratio(reference, name) if name != reference else None
        rows[name] = {
            'median_ms': 1e3 * timings.median(name),
            'min_ms': 1e3 * timings.min(name),
            'images_per_s': images / timings.median(name),
            f'speedup_vs_{reference}': None if ratio is None else ratio.median,
            'interval': None if ratio is None else ratio.interval,
        }
    return {'rows': rows, 'errors': timings.errors, 'rounds': timings.rounds}


def speedup_cell(row: dict[str, Any]) -> str:
    """A variant's median speedup over the reference (NCHW) with its 95% interval where there is one; the
    reference itself is 1.00x."""
    speedup, interval = _speedup(row), row.get('interval')
    if speedup is None:
        return '1.00x'
    return f'{speedup:.2f}x' + (f' ({interval[0]:.2f}-{interval[1]:.2f})' if interval else '')


def _speedup(row: dict[str, Any]) -> Any:
    """The row's ``speedup_vs_<reference>``: None for the reference itself."""
    return next((value for key, value in row.items() if key.startswith('speedup_vs_')), None)


def _timed_table(result: dict[str, Any]) -> list[str]:
    """One row per variant: median and min ms, images/s, speedup over the reference variant; and any errors."""
    reference = next((name for name, row in result['rows'].items() if _speedup(row) is None), 'the reference')
    lines = [
        f'| variant | median ms | min ms | images/s | over {reference} (95% interval) |',
        '|---|---:|---:|---:|---:|',
    ]
    for name, row in result['rows'].items():
        cells = (f'{row["median_ms"]:.1f}', f'{row["min_ms"]:.1f}', f'{row["images_per_s"]:.0f}', speedup_cell(row))
        lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
    lines += [f'\n{name} failed: {error}' for name, error in result.get('errors', {}).items()]
    return lines + [f'\n{result["rounds"]} interleaved rounds.']


def _zoo_table(result: dict[str, Any]) -> list[str]:
    lines = [
        '| model | NCHW ms | plain channels last | this project | auto kept | breaks after the rules |',
        '|---|---:|---:|---:|---|---|',
    ]
    for model, entry in result.items():
        if 'rows' not in entry:
            lines.append(f'| {model} | {entry.get("skipped") or entry.get("error")} | | | | |')
            continue
        rows = entry['rows']
        cells = [f'{rows["nchw"]["median_ms"]:.1f}' if 'nchw' in rows else '-']
        cells += [
            speedup_cell(rows[name]) if name in rows else '-' for name in ('to_channels_last', 'channels_last_algo')
        ]
        cells += [entry['auto_kept'], '; '.join(entry['breaks']) or '0']
        lines.append(f'| {model} | ' + ' | '.join(cells) + ' |')
    return lines


def _tests_lines(result: dict[str, Any]) -> list[str]:
    lines = [f'`{result["command"]}`: {result["summary"]} (exit code {result["exit_code"]}).']
    return lines + [f'- failed: `{test}`' for test in result['failed']]


def _part_lines(name: str, result: Any) -> list[str]:
    if not isinstance(result, dict) or 'error' in result or 'skipped' in result:
        return [f'{result}']
    if name == 'machine':
        return [', '.join(f'{key} {value}' for key, value in result.items())]
    if name == 'tests':
        return _tests_lines(result)
    if name in ('resnet50', 'group_norm'):  # per precision; per shape
        return [line for key, timed in result.items() for line in (f'\n{key}:\n', *_timed_table(timed))]
    if name == 'zoo':
        return _zoo_table(result)
    return _timed_table(result)


def summary(records: dict[str, dict[str, Any]]) -> str:
    """The Markdown page of the parts' records (``{'part', 'seconds', 'result'}``), in the suite's order."""
    lines = ['# GPU suite', '']
    for name in [part for part in PART_ORDER if part in records]:
        record = records[name]
        lines += [f'## {name} ({record["seconds"]} s)', '', *_part_lines(name, record['result']), '']
    return '\n'.join(lines)


def write_summary(out: Path) -> Path:
    """Write ``out/summary.md`` from the part files in ``out``; returns its path."""
    records = {path.stem: json.loads(path.read_text()) for path in out.glob('*.json') if path.stem in PART_ORDER}
    path = out / 'summary.md'
    path.write_text(summary(records))
    return path


if __name__ == '__main__':
    print(write_summary(Path(sys.argv[1])))
