"""The benchmarks' shared scaffolding keeps its examples true: the model zoos, the results writer and
the shared options live outside the package, where ``--doctest-modules`` does not reach, so their
doctests run here."""

import doctest
import importlib
import sys

import pytest

import conftest  # puts the repository root on sys.path, for `benchmarks`

sys.path.insert(0, str(conftest.ROOT / 'benchmarks'))  # the scripts import their neighbours by their own names


@pytest.mark.parametrize(
    'module',
    [
        'benchmarks.zoo_models',
        'benchmarks.functional_models',
        'benchmarks.functional_attention',
        'benchmarks.functional_blocks',
        'benchmarks.results_writer',
        'benchmarks.arguments',
        'benchmarks.zoo_report',
        'benchmarks.gpu_report',
        'benchmarks.gpu_suite',
        'benchmarks.group_norm_forms',
    ],
)
def test_examples_hold(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0
    assert result.failed == 0
