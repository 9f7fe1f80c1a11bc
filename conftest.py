"""Doctest collection across the two test environments, and one check on every test and doctest.

An integration module whose trainer is not installed here (Composer in the newest-torch
environment, Lightning in the Composer one) is not collected: each is named for its trainer's
package (``integrations/composer*.py``, ``integrations/lightning*.py``). The doctests of the
application modules that build Composer objects are skipped where Composer is missing, and the
tests marked ``cuda`` where no CUDA device is (``./run gpu`` runs them: ``pytest -m cuda``).

A test that leaves a ``TorchFunctionMode`` on (a view watch or a first batch's input search that
never saw its forward end) would change what every later test in the process sees: it fails
where it happened, and the modes it left are taken off.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from channels_last_algo.integrations import INTEGRATIONS

# Application modules that import Composer at the top: the checkpoints of recipe runs.
COMPOSER_MODULES = ('channels_last_algo/app/runs/run_checkpoints.py',)

INTEGRATION_FOLDER = Path('channels_last_algo', 'integrations')

collect_ignore = sorted(
    {
        str(path.relative_to(Path(__file__).parent))
        for package in {package for _, package, _ in INTEGRATIONS.values()}
        if importlib.util.find_spec(package) is None
        for path in (Path(__file__).parent / INTEGRATION_FOLDER).glob(f'{package}*.py')
    }
    | (set(COMPOSER_MODULES) if importlib.util.find_spec('composer') is None else set())
)

# Doctests (module or object names) that build Composer Trainers, DataSpecs or algorithms.
COMPOSER_DOCTESTS = (
    'channels_last_algo.app.recipes.loading',
    'channels_last_algo.app.recipes.placement',
    'channels_last_algo.app.runs.compare',
    'channels_last_algo.app.data.loaders.build_data_spec',
)


def pytest_collection_modifyitems(config, items):
    no_composer = importlib.util.find_spec('composer') is None
    no_cuda = not torch.cuda.is_available()
    for item in items:
        if no_composer and isinstance(item, pytest.DoctestItem) and item.name.startswith(COMPOSER_DOCTESTS):
            item.add_marker(pytest.mark.skip(reason='builds Composer objects; Composer is not installed here'))
        if no_cuda and item.get_closest_marker('cuda') is not None:
            item.add_marker(pytest.mark.skip(reason='needs a CUDA device'))


_TORCH_VIEWS = {name: getattr(torch.Tensor, name) for name in ('view', 'view_as')}


@pytest.fixture(autouse=True)
def no_torch_function_mode_left_on():
    """No test leaves a mode on, nor the late-view wrappers on ``torch.Tensor`` (core/late_views.py)."""
    before = torch._C._len_torch_function_stack()
    yield
    left = [
        type(torch._C._get_function_stack_at(i)).__name__ for i in range(before, torch._C._len_torch_function_stack())
    ]
    while torch._C._len_torch_function_stack() > before:
        torch._C._pop_torch_function_stack()
    left += [
        f'a wrapper of Tensor.{name}'
        for name, method in _TORCH_VIEWS.items()
        if getattr(torch.Tensor, name) is not method
    ]
    for name, method in _TORCH_VIEWS.items():
        setattr(torch.Tensor, name, method)
    if left:
        pytest.fail(f'the test left torch function modes on: {left}')
