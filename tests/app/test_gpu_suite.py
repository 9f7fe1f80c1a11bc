"""The GPU suite's whole script, run on the CPU as ``--smoke`` (small models and inputs, two rounds), so that
the call a lent GPU machine gets works the first time. It runs in the newest environment only: the GPU
machines have torch 2.11 and no Composer, and the smoke run costs about two minutes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from channels_last_algo.core.runtime import version_in

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'benchmarks'))  # the suite imports its neighbours by their own names
VARIANTS = {'nchw', 'to_channels_last', 'channels_last_algo', 'compile_nchw', 'compile_channels_last_algo'}


@pytest.mark.skipif(not version_in(torch.__version__, '>=2.11'), reason='the GPU machines have torch 2.11 or newer')
def test_the_smoke_run_writes_every_part_with_every_variant(tmp_path):
    # a budget no part runs short of on a slow, busy CPU (about two minutes on a quiet one)
    command = [sys.executable, 'benchmarks/gpu_suite.py', '--smoke', '--out', str(tmp_path), '--budget', '900']
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=1800, env=os.environ | {'PYTHONPATH': '.'}
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    parts = {path.stem: json.loads(path.read_text())['result'] for path in tmp_path.glob('*.json')}
    assert set(parts) == {'machine', 'tests', 'resnet50', 'zoo', 'inference', 'group_norm'}
    assert parts['tests']['exit_code'] == 0 and 'skipped' in parts['tests']['summary'], parts['tests']  # -m cuda
    training = parts['resnet50']['bf16']
    assert set(training['rows']) == VARIANTS and training['errors'] == {}
    speedups = [row['speedup_vs_nchw'] for name, row in training['rows'].items() if name != 'nchw']
    assert all(math.isfinite(s) and s > 0 for s in speedups), training  # two rounds on a CPU: numbers, not speeds
    for name, result in parts['zoo'].items():
        assert result['auto_kept'] in ('channels_last', 'channels_first'), (name, result)
        assert isinstance(result['breaks_after_rules'], int)
    assert set(parts['inference']['rows']) == {'nchw', 'channels_last', 'fused', 'compile_channels_last'}
    page = (tmp_path / 'summary.md').read_text()  # one page of tables, beside the five parts' files
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [*(f'{part}.json' for part in parts), 'summary.md']
    )
    assert all(f'## {part} (' in page for part in parts) and '| compile_channels_last_algo | ' in page
    assert '| resnet18_groupnorm | ' in page
    forms = parts['group_norm']['2x64x16x16']
    assert set(forms['rows']) == {'native', 'nhwc', 'per_channel'} and forms['errors'] == {}, forms


def test_the_tests_part_keeps_the_failures_short_tracebacks():
    from benchmarks import gpu_suite

    output = 'tests/a.py::test_x FAILED\n=== FAILURES ===\n___ test_x ___\nE   AssertionError: 1 != 2\n=== 1 failed ==='
    assert gpu_suite._failures(output).startswith(
        '=== FAILURES ==='
    ) and 'AssertionError: 1 != 2' in gpu_suite._failures(output)
    assert gpu_suite._failures('x' * 50, limit=10) == 'x' * 10  # no section: the output's end


def test_a_gpu_run_writes_under_the_devices_results_folder_and_a_smoke_run_only_where_told():
    from benchmarks import gpu_suite

    assert (
        gpu_suite.results_folder('NVIDIA H100 80GB HBM3', '2.11')
        == ROOT / 'benchmarks/results/nvidia-h100-80gb-hbm3-torch2.11'
    )
    with pytest.raises(SystemExit):  # a smoke run's numbers are no results to keep
        gpu_suite.parse_args(['--smoke'])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_suite.parse_args([])
    else:
        assert gpu_suite.parse_args([]).out is None  # main() puts it under results_folder
