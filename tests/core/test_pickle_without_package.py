"""A whole guarded model saved with ``torch.save`` loads where this package is not installed: its
swapped layers (repairs and safe paths) pickle as their original classes with the same state, the hooks
that make viewed outputs channels first as torch's graph modules, and copies of the model
(``copy.deepcopy``, ``copy.copy``) keep the swapped classes and the package's hooks."""

import copy
import inspect
import pathlib
import pickle
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torchvision.models.shufflenetv2 import InvertedResidual
from viewing_model import Pair, ViewedEverywhere

from channels_last_algo import LayoutGuard, apply_channels_last
from channels_last_algo.core.channels_first_outputs import channels_first_output
from channels_last_algo.core.layers import repair_model
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety import KNOWN_BUGS, make_safe

HERE = pathlib.Path(__file__).parent
ONEDNN = next(bug for bug in KNOWN_BUGS if bug.name == 'onednn_1x1_strided_weight_grad')
XEON = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX512')

# The child: this package cannot be imported (a finder ahead of all others refuses it); each model named
# is loaded whole, run on its saved NCHW input and pickled again; it saves the outputs, the classes and
# the modules of the forward hooks.
LOAD_WITHOUT_PACKAGE = """
import importlib.abc, pickle, sys

class NoPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] == 'channels_last_algo':
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
        return None

sys.meta_path.insert(0, NoPackage())
import torch

classes_path, *names = sys.argv[1:]
sys.path.insert(0, classes_path)  # where the models' own classes are
results = {}
for name in names:
    model = torch.load(f'{name}.pt', weights_only=False)
    results[name] = {
        'classes': sorted({f'{type(m).__module__}.{type(m).__qualname__}' for m in model.modules()}),
        'hooks': sorted({type(h).__module__ for m in model.modules() for h in m._forward_hooks.values()}),
        'output': model(torch.load(f'{name}-input.pt')),
    }
    pickle.loads(pickle.dumps(model))  # saved again, as loaded
loaded = sorted(name for name in sys.modules if name.partition('.')[0] == 'channels_last_algo')
torch.save({'loaded': loaded, 'models': results}, 'outputs.pt')
"""


def stem_net() -> nn.Module:
    """A 1x1 stride-2 RGB stem (the oneDNN safe path where that bug applies), a ShuffleNetV2 block
    (the channel shuffle repair) and a global average pool (the global pool repair), in float64."""
    torch.manual_seed(0)
    layers = OrderedDict(
        stem=nn.Conv2d(3, 8, 1, stride=2, bias=False),
        norm=nn.BatchNorm2d(8),
        act=nn.ReLU(),
        block=InvertedResidual(8, 8, 1),
        pool=nn.AdaptiveAvgPool2d(1),
        flat=nn.Flatten(),
        head=nn.Linear(8, 4),
    )
    return nn.Sequential(layers).double().eval()


def _guarded_stem_net() -> tuple[nn.Module, object]:
    model = stem_net()
    guard = LayoutGuard()
    summary = guard.on_init(model)
    guard.close()
    return model, summary


@pytest.fixture(scope='module')
def without_package(tmp_path_factory) -> dict:
    """The guarded models saved whole and run by one child without this package (a Python that starts takes
    seconds): {name: (model, its guard's summary or the guard, its NCHW input, the child's result)}."""
    folder = tmp_path_factory.mktemp('saved')
    torch.manual_seed(0)
    guard = LayoutGuard()
    models = {'stem': _guarded_stem_net(), 'viewed': (_trained(ViewedEverywhere().double(), guard), guard)}
    inputs = {}
    for name, (model, _) in models.items():
        size = 16 if name == 'stem' else 8
        inputs[name] = torch.randn(2, 3, size, size, dtype=torch.float64)
        torch.save(model, folder / f'{name}.pt')
        torch.save(inputs[name], folder / f'{name}-input.pt')
    command = [sys.executable, '-I', '-c', LOAD_WITHOUT_PACKAGE, str(HERE), *models]
    child = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    outputs = torch.load(folder / 'outputs.pt', weights_only=False)
    assert outputs['loaded'] == []
    for result in outputs['models'].values():
        assert not [name for name in result['classes'] + result['hooks'] if name.startswith('channels_last_algo')]
    return {name: (*models[name], inputs[name], outputs['models'][name], folder / f'{name}.pt') for name in models}


def test_a_saved_guarded_model_loads_and_runs_where_the_package_is_missing(without_package):
    model, summary, x, loaded, _ = without_package['stem']
    assert sorted(r.reason for r in summary.repaired) == ['global_avg_pool', 'shufflenet_channel_shuffle']
    assert [r.path for r in summary.made_safe] == (['stem'] if ONEDNN.affects(Runtime.current('cpu')) else [])
    with torch.no_grad():
        torch.testing.assert_close(loaded['output'], model(x), rtol=1e-12, atol=1e-12)


def test_a_swapped_layer_pickles_as_its_original_class_and_copies_keep_the_swap():
    model = stem_net()
    records = make_safe(model, runtimes=[XEON]) + repair_model(model)
    swapped = {r.path: type(model.get_submodule(r.path)) for r in records}
    assert set(swapped) == {'stem', 'block', 'pool'}
    restored = pickle.loads(pickle.dumps(model))
    originals = [nn.Conv2d, InvertedResidual, nn.AdaptiveAvgPool2d]
    assert [type(restored.get_submodule(path)) for path in swapped] == originals
    deep = copy.deepcopy(model)
    assert {path: type(deep.get_submodule(path)) for path in swapped} == swapped
    shallow = copy.copy(model.stem)
    assert type(shallow) is swapped['stem'] and shallow.weight is model.stem.weight
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(deep(x), model(x), rtol=0, atol=0)
        torch.testing.assert_close(restored(x), model(x), rtol=1e-12, atol=1e-12)


class InitStem(nn.Conv2d):
    """A stem whose own initialisation is all it adds."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.5)


def test_a_swapped_subclass_pickles_as_itself_and_a_parametrized_one_refuses_as_torch_does():
    model = nn.Sequential(InitStem(3, 8, 1, stride=2), weight_norm(nn.Conv2d(3, 8, 1, stride=2)))
    parametrized = type(model[1])
    assert [r.path for r in make_safe(model, runtimes=[XEON])] == ['0', '1']
    assert type(pickle.loads(pickle.dumps(model[0]))) is InitStem
    with pytest.raises(RuntimeError, match='Serialization of parametrized modules'):
        pickle.dumps(model[1])  # torch's refusal, as without the swap
    copied = copy.deepcopy(model)
    assert [type(m) for m in copied] == [type(m) for m in model]
    assert isinstance(copied[1], parametrized) and copied[1].parametrizations.weight.original1 is not None


def _trained(model: nn.Module, guard: LayoutGuard) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard.on_init(model, optimizer)
    for _ in range(2):
        batch = guard.on_batch(torch.randn(2, 3, 8, 8, dtype=torch.float64))
        with guard.step():
            model(batch).square().mean().backward()
        optimizer.step()
        guard.on_batch_end()
    guard.close()
    return model


def _hook_kinds(model: nn.Module) -> dict:
    """Each module's forward hooks: the function, or the class of a callable object."""
    kinds = {
        path: [h if inspect.isfunction(h) else type(h) for h in m._forward_hooks.values()]
        for path, m in model.named_modules()
    }
    return {path: hooks for path, hooks in kinds.items() if hooks}


def test_a_model_whose_outputs_are_made_channels_first_loads_and_views_where_the_package_is_missing(without_package):
    """The hooks that make viewed outputs channels first pickle as torch's own graph modules: the child runs
    the views as NCHW does and saves the model again; copies keep the package's hooks, and
    ``apply_channels_last`` given the loaded model takes them back."""
    model, guard, x, loaded, path = without_package['viewed']
    assert sorted(guard._viewed.placed) == ['block', 'conv', 'pair']
    (pair_hook,) = (
        model.pair._forward_hooks.values()
    )  # its outputs, contiguous since conv's are, made so on loading too
    assert pair_hook.layout == (Pair, {0: True, 1: (dict, {'shifted': True, 'channels': False})})
    assert loaded['hooks'] == ['torch.fx.graph_module']
    with torch.no_grad():
        torch.testing.assert_close(loaded['output'], model(x), rtol=1e-12, atol=1e-12)
    hooks = _hook_kinds(model)
    assert _hook_kinds(copy.deepcopy(model)) == hooks and hooks['conv'] == [channels_first_output]
    loaded_here = torch.load(path, weights_only=False)
    assert all(isinstance(h, torch.fx.GraphModule) for m in loaded_here.modules() for h in m._forward_hooks.values())
    apply_channels_last(loaded_here)  # as a guard does
    assert _hook_kinds(loaded_here) == hooks
