"""Auto mode's evidence rule under simulated noise: how often decide_layout keeps each layout.

No real timing: decide_layout runs on a one-layer model with a fake clock, and each trial
step advances the clock by its layout's cost times log-normal noise (``--sigma``), times
``--spike`` with probability ``--spike-rate`` (bursts of load from other work). For each true
speedup of channels last and each noise level, ``--seeds`` decisions are made; the table gives
the share that kept NCHW, kept channels last on evidence, and kept channels last as a tie (the
default), the median rounds taken, and, for comparison, the share of wrong choices the former
rule made (3 steps per layout, channels last kept when its median step is 2% faster) on the
first three rounds of the same simulated runs.

    python benchmarks/auto_rule.py                      # the table in docs/auto.md
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys

import torch
from arguments import benchmark_parser  # benchmarks/, next to this script
from results_writer import RunStart, run_record, write_results

from channels_last_algo.core.auto import decide_layout
from channels_last_algo.core.layout import MemoryFormat
from channels_last_algo.core.timing import FakeClock

FIRST, LAST = MemoryFormat.CHANNELS_FIRST, MemoryFormat.CHANNELS_LAST
NOISE = {'quiet': (0.05, 0.0), 'loaded': (0.15, 0.1), 'overloaded': (0.3, 0.2)}  # sigma, spike rate


def simulate(speedup: float, sigma: float, spike_rate: float, spike: float, seed: int, max_rounds: int) -> dict:
    """One decision on a fake clock where channels last is ``speedup`` times faster."""
    model = torch.nn.Conv2d(3, 4, 1)
    clock, rng = FakeClock(), random.Random(seed)

    def step(channels_last: bool) -> None:
        noise = math.exp(rng.gauss(0, sigma)) * (spike if rng.random() < spike_rate else 1)
        clock.advance((1 / speedup if channels_last else 1.0) * noise)

    decision = decide_layout(model, step, max_rounds=max_rounds, max_seconds=math.inf, timer=clock)
    first, last = decision.nchw_seconds[:3], decision.channels_last_seconds[:3]
    return {
        'kept': FIRST if not decision.channels_last else 'tie' if decision.tie else LAST,
        'rounds': decision.rounds,
        'former_rule_channels_last': statistics.median(last) < 0.98 * statistics.median(first),
    }


def _share(runs: list[dict], test) -> float:
    return sum(map(test, runs)) / len(runs)


def summarise(runs: list[dict], speedup: float) -> dict:
    """Shares of each choice over ``runs``; "wrong" only where the true speedup is beyond the tie band."""
    faster, tie = speedup > 1.02, abs(math.log(speedup)) <= math.log(1.02)
    wrong_now = (lambda r: r['kept'] == FIRST) if faster else (lambda r: r['kept'] != FIRST)
    return {
        'kept_nchw': _share(runs, lambda r: r['kept'] == FIRST),
        'kept_channels_last': _share(runs, lambda r: r['kept'] == LAST),
        'tie': _share(runs, lambda r: r['kept'] == 'tie'),
        'median_rounds': statistics.median(r['rounds'] for r in runs),
        'wrong_now': None if tie else _share(runs, wrong_now),
        'wrong_former_rule': None if tie else _share(runs, lambda r: r['former_rule_channels_last'] is not faster),
    }


def table(args: argparse.Namespace) -> list[dict]:
    rows = []
    for noise, (sigma, spike_rate) in NOISE.items():
        for speedup in args.speedups:
            runs = [
                simulate(speedup, sigma, spike_rate, args.spike, seed, args.max_rounds) for seed in range(args.seeds)
            ]
            rows.append(
                {
                    'noise': noise,
                    'sigma': sigma,
                    'spike_rate': spike_rate,
                    'speedup': speedup,
                    **summarise(runs, speedup),
                }
            )
    return rows


def markdown(result: dict) -> str:
    s = result['settings']
    lines = [
        "# Auto mode's evidence rule under simulated noise",
        '',
        f'Command: `{result["command"]}`',
        '',
        f'{s["seeds"]} decisions per cell, at most {s["max_rounds"]} paired rounds, 95% interval, tie band 2%. Noise '
        f'per step: log-normal with sigma as given, times {s["spike"]} with the spike rate. "wrong": NCHW kept '
        'where channels last is faster, or channels last kept where it is slower (a tie counts as channels last); '
        'the former rule: 3 steps per layout, medians compared.',
        '',
        '| noise | sigma, spikes | true speedup | kept NCHW | kept channels last | tie (default) | median rounds '
        '| wrong | wrong, former rule |',
        '|---|---|---:|---:|---:|---:|---:|---:|---:|',
    ]
    percent = lambda value: '' if value is None else f'{value:.0%}'
    for r in result['rows']:
        lines.append(
            f'| {r["noise"]} | {r["sigma"]}, {r["spike_rate"]:.0%} | {r["speedup"]:.2f}x | '
            f'{percent(r["kept_nchw"])} | {percent(r["kept_channels_last"])} | {percent(r["tie"])} | '
            f'{r["median_rounds"]:.0f} | {percent(r["wrong_now"])} | {percent(r["wrong_former_rule"])} |'
        )
    return '\n'.join(lines) + '\n'


def main(argv=None) -> int:
    start = RunStart.now()
    parser = benchmark_parser(__doc__, out='folder for auto_rule.json and auto_rule.md (else print only)', epilog=False)
    parser.add_argument('--speedups', type=float, nargs='+', default=[0.7, 0.81, 0.9, 0.95, 1.0, 1.05, 1.1, 1.41])
    parser.add_argument('--seeds', type=int, default=200)
    parser.add_argument('--max-rounds', type=int, default=60)
    parser.add_argument('--spike', type=float, default=2.5, help='how much slower a step hit by a burst of load is')
    args = parser.parse_args(argv)
    rows = table(args)
    result = run_record('auto_rule', start, argv, settings=vars(args) | {'out': str(args.out)}, rows=rows)
    text = markdown(result)
    print(text)
    if args.out is not None:
        write_results(args.out, 'auto_rule', result, text)
    return 0


if __name__ == '__main__':
    sys.exit(main())
