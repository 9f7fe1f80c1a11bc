"""The report of ``benchmarks/inference.py``: the verdict against inductor-freezing and the
Markdown table of its results.

Example:
    >>> row = {'variant': 'fused', 'speedup_vs_inductor': 1.05, 'speedup_vs_inductor_interval': (1.01, 1.09)}
    >>> group = {'model': 'resnet50', 'dtype': 'float32', 'rows': [row]}
    >>> inductor_verdicts([group], smoke=False)[0].split('; ')[0]
    'float32: ResNet-50: fused 1.05x inductor-freezing (95% interval 1.01-1.09)'
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

from channels_last_algo.core.machine_description import machine_label

__all__ = ['inductor_verdicts', 'markdown', 'times']

FUSED_VARIANTS = ('fused', 'fused (inductor)')


def _row(group: dict, variant: str) -> Optional[dict]:
    return next((row for row in group['rows'] if row['variant'] == variant), None)


def _best_fused(group: dict) -> Optional[dict]:
    """The faster (by the paired ratio over inductor) of the fused path's variants measured."""
    rows = [row for row in map(lambda v: _row(group, v), FUSED_VARIANTS) if row and 'speedup_vs_inductor' in row]
    return max(rows, key=lambda row: row['speedup_vs_inductor'], default=None)


def inductor_verdicts(groups: list[dict], smoke: bool) -> list[str]:
    """Per dtype: the fused path (the better of eager and compiled) against inductor-freezing on
    ResNet-50 and on the geometric mean over the models; the target is ahead on both."""
    lines = []
    prefix = 'smoke run, timings meaningless: ' if smoke else ''
    for dtype in dict.fromkeys(group['dtype'] for group in groups):
        pairs = [(group, _best_fused(group)) for group in groups if group['dtype'] == dtype]
        pairs = [(group, best) for group, best in pairs if best is not None]
        if not pairs:
            continue
        parts = []
        for group, best in pairs:
            if group['model'] == 'resnet50':
                low, high = best['speedup_vs_inductor_interval'] or (math.nan, math.nan)
                parts.append(
                    f'ResNet-50: {best["variant"]} {best["speedup_vs_inductor"]:.2f}x inductor-freezing '
                    f'(95% interval {low:.2f}-{high:.2f})'
                )
        geomean = math.exp(statistics.fmean(math.log(best['speedup_vs_inductor']) for _, best in pairs))
        parts.append(
            f'geometric mean over {len(pairs)} models {geomean:.2f}x (best fused variant per model: '
            + ', '.join(f'{group["model"]} {best["variant"]}' for group, best in pairs)
            + ')'
        )
        resnet = next((best for group, best in pairs if group['model'] == 'resnet50'), None)
        ahead = geomean > 1 and (resnet is None or resnet['speedup_vs_inductor'] > 1)
        parts.append(f'target (fused path ahead of inductor-freezing): {"met" if ahead else "MISSED"}')
        lines.append(f'{prefix}{dtype}: ' + '; '.join(parts) + '.')
    return lines


def bf16_note(groups: list[dict]) -> list[str]:
    """Per model: the fused path under autocast against the converted copy."""
    lines = []
    for group in groups:
        autocast, converted = _row(group, 'fused'), _row(group, 'fused (copy)')
        if group['dtype'] != 'float32' and autocast and converted:
            ratio = converted['median_images_per_s'] / autocast['median_images_per_s']
            lines.append(
                f'{group["model"]} {group["dtype"]}: the converted copy runs at {ratio:.2f}x the autocast '
                'median throughput'
            )
    return lines


def times(row: dict, key: str) -> str:
    return f'{row[key]:.2f}x' if key in row else '-'


def _header(result: dict) -> list[str]:
    """The title, the machine, the command, the load and the settings."""
    m, s = result['machine'], result['settings']
    return [
        '# Inference throughput: fused NHWC against NCHW eager, channels last, Composer, TorchScript and inductor',
        '',
        f'Machine: {machine_label(m)}; {m["cores_usable"]} usable cores ({m["cores"]} online), '
        f'GPU: {m["gpu"] or "none"}; device `{s["device"]}`. Python {m["python"]}, torch {m["torch"]}, '
        f'torchvision {m["torchvision"]}.',
        '',
        f'Command: `{result["command"]}` ({result["date"]})',
        '',
        f'1-minute load average {result["load_average_1min"]["before"]:.1f} before and '
        f'{result["load_average_1min"]["after"]:.1f} after the run (other work on the machine makes rounds vary).',
        '',
        f'Batch {s["batch_size"]} at {s["image_size"]}x{s["image_size"]}, random weights (torchvision, '
        f'`weights=None`), {s["warmup"]} warm-up rounds, {s["rounds"]} interleaved timed rounds. Images/s from '
        'the best and the median round; "vs NCHW" and "vs inductor" are the medians over rounds of that '
        "variant's time over this one's in the same round (above 1: this one is faster). `fused (inductor)` is "
        "`fuse_for_inference(model, backend='inductor')`: where it beats `fused`, that is the option to use.",
        '',
    ]


def _table(groups: list[dict]) -> list[str]:
    """One row per measured variant of every group."""
    lines = [
        '',
        '| model | dtype | variant | best img/s | median img/s | vs NCHW | vs inductor | how |',
        '|---|---|---|---:|---:|---:|---:|---|',
    ]
    for group in groups:
        for row in group['rows']:
            lines.append(
                f'| {row["model"]} | {row["dtype"]} | {row["variant"]} | {row["best_images_per_s"]:.1f} | '
                f'{row["median_images_per_s"]:.1f} | {times(row, "speedup_vs_nchw")} | '
                f'{times(row, "speedup_vs_inductor")} | {row["how"]} |'
            )
    return lines


def _notes(groups: list[dict]) -> list[str]:
    """What was fused, the seconds to a first call, reduced precision's note, and what was not measured."""
    lines = ['', 'What was fused (fx route: patterns matched on a symbolic trace):', '']
    seen = set()
    for group in groups:
        if 'fusion' in group and group['model'] not in seen:
            seen.add(group['model'])
            lines.append(f'- {group["model"]}: {group["fusion"]}')
    lines += ['', 'Seconds to build each variant and make its first call (compiling included):', '']
    for group in groups:
        first = ', '.join(f'{name} {seconds:.1f}' for name, seconds in group['first_call_seconds'].items())
        lines.append(f'- {group["model"]} {group["dtype"]}: {first}')
    notes = bf16_note(groups)
    if notes:
        lines += ['', 'Reduced precision, fused path, autocast against a converted copy:', '']
        lines += [f'- {line}' for line in notes]
    skipped = sorted({f'{name}: {why}' for group in groups for name, why in group['skipped'].items()})
    if skipped:
        lines += ['', 'Not measured: ' + '; '.join(skipped) + '.']
    return lines


def markdown(result: dict) -> str:
    verdicts = [f'**{line}**' for line in inductor_verdicts(result['groups'], result['settings']['smoke'])]
    return '\n'.join([*_header(result), *verdicts, *_table(result['groups']), *_notes(result['groups'])]) + '\n'
