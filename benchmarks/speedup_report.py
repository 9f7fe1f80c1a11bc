"""The report of ``benchmarks/speedup.py``: the issue's targets checked against the rows, the
Markdown tables, and a bar chart of the speedups (with matplotlib).

Example:
    >>> rows = [{'model': 'resnet50', 'mode': 'train', 'dtype': 'fp32', 'variant': 'auto', 'speedup_vs_nchw': 1.2,
    ...          'noise_vs_nchw': 0.05}]
    >>> check_targets(rows)[0]['met']
    True
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional

from channels_last_algo.core.machine_description import machine_label

__all__ = ['check_targets', 'chart', 'markdown']

VARIANTS = ('nchw', 'composer', 'timm', 'channels_last_algo', 'auto')


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float('nan')


def _find(rows: list[dict], model: str, mode: str, dtype: str, variant: str) -> Optional[dict]:
    return next(
        (r for r in rows if (r['model'], r['mode'], r['dtype'], r['variant']) == (model, mode, dtype, variant)),
        None,
    )


def _resnet50_targets(rows: list[dict]) -> list[dict]:
    """ResNet-50 fp32 training: 1.25x over NCHW, and not slower than Composer's ChannelsLast."""
    ours = _find(rows, 'resnet50', 'train', 'fp32', 'channels_last_algo')
    if not (ours and 'speedup_vs_nchw' in ours):
        return []
    return [
        {
            'target': 'ResNet-50 fp32 training >= 1.25x over NCHW',
            'value': f'{ours["speedup_vs_nchw"]:.2f}x',
            'met': ours['speedup_vs_nchw'] >= 1.25,
        },
        {
            'target': "ResNet-50 fp32 training not slower than Composer's ChannelsLast",
            'value': f'{ours["speedup_vs_composer"]:.2f}x',
            'met': ours['speedup_vs_composer'] >= 1 - ours['noise_vs_composer'],
        },
    ]


def _geomean_target(rows: list[dict], mode: str, dtype: str) -> Optional[dict]:
    """This project's geometric mean speedup above Composer's, over the models both ran."""
    pairs = [
        (_find(rows, r['model'], mode, dtype, 'channels_last_algo'), r)
        for r in rows
        if (r['mode'], r['dtype'], r['variant']) == (mode, dtype, 'composer') and 'speedup_vs_nchw' in r
    ]
    pairs = [(o, c) for o, c in pairs if o and 'speedup_vs_nchw' in o]
    if not pairs:
        return None
    ours_mean = _geomean([o['speedup_vs_nchw'] for o, _ in pairs])
    composer_mean = _geomean([c['speedup_vs_nchw'] for _, c in pairs])
    return {
        'target': f"{mode} {dtype}: geometric mean speedup of this project above Composer's",
        'value': f'{ours_mean:.2f}x vs {composer_mean:.2f}x over {len(pairs)} models',
        'met': ours_mean > composer_mean,
    }


def _auto_target(rows: list[dict], mode: str, dtype: str) -> Optional[dict]:
    """Auto mode slower than NCHW beyond noise (at least 3%) on no model."""
    auto_rows = [r for r in rows if (r['mode'], r['dtype'], r['variant']) == (mode, dtype, 'auto')]
    if not auto_rows:
        return None
    slower = [
        r for r in auto_rows if 'speedup_vs_nchw' in r and r['speedup_vs_nchw'] < 1 - max(r['noise_vs_nchw'], 0.03)
    ]
    return {
        'target': f'{mode} {dtype}: auto mode slower than NCHW beyond noise on no model',
        'value': ', '.join(f'{r["model"]} {r["speedup_vs_nchw"]:.2f}x' for r in slower) or 'none slower',
        'met': not slower,
    }


def check_targets(rows: list[dict]) -> list[dict]:
    """The issue's targets, each with whether this run met it."""
    targets = _resnet50_targets(rows)
    for mode in ('train', 'infer'):
        for dtype in sorted({r['dtype'] for r in rows}):
            found = (_geomean_target(rows, mode, dtype), _auto_target(rows, mode, dtype))
            targets += [target for target in found if target is not None]
    return targets


def markdown(result: dict) -> str:
    lines = [
        f'# Training and inference speedup: {machine_label(result["machine"])}',
        '',
        f'Command: `{result["command"]}`',
        '',
        f'Batch {result["settings"]["batch_size"]} x 3 x {result["settings"]["image_size"]} x '
        f'{result["settings"]["image_size"]}, {result["settings"]["steps"]} timed steps per variant after '
        f'{result["settings"]["warmup"]} warm-up, interleaved round by round in one process. Speedups are the '
        'median of per-round ratios (+- half the interquartile range); breaks: layout audit of one step.',
        '',
    ]
    lines += ['## Targets', '', '| target | this run | met |', '|---|---|---|']
    lines += [f'| {t["target"]} | {t["value"]} | {"yes" if t["met"] else "**no**"} |' for t in result['targets']]
    groups = sorted(
        {(r['mode'], r['dtype']) for r in result['rows']}, key=lambda g: (g[0] != 'train', g[1] != 'fp32', g)
    )
    for mode, dtype in groups:
        lines += [
            '',
            f'## {"Training" if mode == "train" else "Inference"}, {dtype}',
            '',
            '| model | variant | median ms | min ms | images/s | vs NCHW | vs Composer | breaks | notes |',
            '|---|---|---:|---:|---:|---:|---:|---:|---|',
        ]
        for r in (r for r in result['rows'] if (r['mode'], r['dtype']) == (mode, dtype)):
            if r['error'] or not r['times_s']:
                lines.append(f'| {r["model"]} | {r["variant"]} | failed | | | | | | {r["error"] or "no timing"} |')
                continue
            vs = lambda key, r=r: (
                f'{r[f"speedup_vs_{key}"]:.2f}x +- {r[f"noise_vs_{key}"]:.2f}' if f'speedup_vs_{key}' in r else ''
            )
            lines.append(
                f'| {r["model"]} | {r["variant"]} | {r["median_s"] * 1e3:.1f} | {r["min_s"] * 1e3:.1f} | '
                f'{r["images_per_s"]:.1f} | {vs("nchw")} | {vs("composer")} | '
                f'{"" if r["breaks"] is None else r["breaks"]} | {r["note"]} |'
            )
    return '\n'.join(lines) + '\n'


def chart(result: dict, path: Path) -> Optional[Path]:
    """A bar chart of the speedups over NCHW, one panel per mode and precision (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install -e .[bench]); no chart written', file=sys.stderr)
        return None
    groups = sorted(
        {(r['mode'], r['dtype']) for r in result['rows']}, key=lambda g: (g[0] != 'train', g[1] != 'fp32', g)
    )
    variants = [v for v in VARIANTS + ('compile',) if v != 'nchw' and any(r['variant'] == v for r in result['rows'])]
    fig, axes = plt.subplots(len(groups), 1, figsize=(12, 3.2 * len(groups)), squeeze=False)
    for ax, (mode, dtype) in zip(axes[:, 0], groups):
        models = list(dict.fromkeys(r['model'] for r in result['rows'] if (r['mode'], r['dtype']) == (mode, dtype)))
        width = 0.8 / len(variants)
        for index, variant in enumerate(variants):
            values = [(_find(result['rows'], m, mode, dtype, variant) or {}).get('speedup_vs_nchw', 0) for m in models]
            ax.bar([i + index * width for i in range(len(models))], values, width, label=variant)
        ax.axhline(1.0, color='black', linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, fontsize=8)
        ax.set_ylabel('speedup vs NCHW')
        ax.set_title(f'{"training" if mode == "train" else "inference"}, {dtype}', fontsize=10)
    axes[0, 0].legend(ncol=len(variants), fontsize=8, loc='upper left')
    fig.suptitle(machine_label(result['machine']), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
