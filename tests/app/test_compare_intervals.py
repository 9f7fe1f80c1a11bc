"""compare's speedups carry their 95% intervals, in the table and the JSON; an interval that holds 1.0 is called a
tie at this noise, and one line says how to get a number to trust. The demo words its interval the same way."""

import json

import pytest
from recipe_runs import RECIPE, TINY, sets

from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.runs.compare import format_comparison
from channels_last_algo.app.runs.demo import speedup_line
from channels_last_algo.core.timing import Ratio

TRUST = 'for a number to trust: more steps (--batches 20 or more) on a quiet machine, with nothing else running'


def _row(variant, vs_nchw, vs_composer):
    """A row of compare's result: speedups as (median, interval) pairs."""
    return {
        'variant': variant,
        'min_s': 0.1,
        'median_s': 0.2,
        'images_per_s': 160.0,
        'layout_breaks': 0,
        'speedup_vs_nchw': vs_nchw[0],
        'speedup_vs_nchw_interval': vs_nchw[1],
        'speedup_vs_composer': vs_composer[0],
        'speedup_vs_composer_interval': vs_composer[1],
    }


def _result(batches, rows):
    """compare's result of ``batches`` timed steps with ``rows``, on a 2-thread CPU."""
    machine = {'gpu': None, 'cpu': 'CPU', 'torch_threads': 2, 'onednn': '3.7.1', 'torch': '2.7.0'}
    sizes = {'batch_size': 32, 'image_size': 128, 'warmup': 2, 'data_workers': 0, 'loader_workers': 0}
    run = {'recipe': 'r', 'model': 'resnet50', 'precision': 'fp32', 'batches': batches, 'confidence': 0.95}
    return {**run, **sizes, 'machine': machine, 'rows': rows}


def test_every_speedup_carries_its_interval_and_a_tie_is_named():
    rows = [
        _row('NCHW', (1.0, None), (0.73, (0.70, 0.76))),
        _row('composer ChannelsLast', (1.38, (1.30, 1.45)), (1.0, None)),
        _row('channels_last_algo', (1.23, (1.10, 1.31)), (0.98, (0.95, 1.02))),
    ]
    lines = format_comparison(_result(8, rows)).splitlines()
    table = lines[4:8]
    assert 'vs NCHW (95% interval)' in table[0] and 'vs Composer (95% interval)' in table[0]
    assert '0.73x (0.70x to 0.76x)' in table[1] and 'tie' not in table[1]
    assert '1.38x (1.30x to 1.45x)' in table[2]
    assert '1.23x (1.10x to 1.31x)' in table[3] and '0.98x (0.95x to 1.02x) tie' in table[3]
    assert lines[-2:] == ['tie: the 95% interval holds 1.0, a tie at this noise', TRUST]


def test_too_few_steps_for_an_interval_say_how_many_give_one():
    rows = [_row('NCHW', (1.0, None), (0.9, None)), _row('channels_last_algo', (1.2, None), (1.1, None))]
    lines = format_comparison(_result(3, rows)).splitlines()
    assert lines[-2:] == ['too few steps for an interval (--batches 6 or more give one)', TRUST]
    assert not any('tie' in line for line in lines)


def test_the_demo_words_its_interval_as_compare_does():
    assert speedup_line(Ratio(1.49, 0.05, (1.36, 1.60), 20, 0.95)).startswith(
        'channels last vs NCHW: 1.49x, the median of 20 paired steps; 95% interval 1.36x to 1.60x. '
    )


def test_compare_writes_the_intervals_to_json_and_prints_them(tmp_path, capsys):
    pytest.importorskip('composer')
    out = tmp_path / 'compare.json'
    overrides = [*TINY, 'train.global_batch_size=2']
    assert main(['compare', RECIPE, '--batches', '6', '--warmup', '0', '--json', str(out), *sets(overrides)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result['confidence'] == 0.95 and result['batches'] == 6
    rows = {row['variant']: row for row in result['rows']}
    assert rows['NCHW']['speedup_vs_nchw_interval'] is None  # a variant against itself
    assert rows['composer ChannelsLast']['speedup_vs_composer_interval'] is None
    measured = [('NCHW', 'vs_composer'), ('composer ChannelsLast', 'vs_nchw')]
    for name, column in measured + [('channels_last_algo', 'vs_nchw'), ('channels_last_algo', 'vs_composer')]:
        low, high = rows[name][f'speedup_{column}_interval']
        assert low <= rows[name][f'speedup_{column}'] <= high
        assert f'{rows[name][f"speedup_{column}"]:.2f}x ({low:.2f}x to {high:.2f}x)' in printed
    assert printed.rstrip().endswith(TRUST)
