"""A whole guarded model saved with ``torch.save`` loads where this package is not installed: its
swapped layers (repairs and safe paths) pickle as their original classes with the same state,
and copies of the model (``copy.deepcopy``, ``copy.copy``) keep the swapped classes."""

import copy
import pickle
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm
from torchvision.models.shufflenetv2 import InvertedResidual

from channels_last_algo import LayoutGuard
from channels_last_algo.core.layers import repair_model
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety import KNOWN_BUGS, make_safe

ONEDNN = next(bug for bug in KNOWN_BUGS if bug.name == 'onednn_1x1_strided_weight_grad')
XEON = Runtime(torch_version=(2, 7, 0), device='cpu', cpu_isa='AVX512')

# The child: this package cannot be imported (a finder ahead of all others refuses it), the model
# is loaded whole and run on the saved NCHW input; it saves the output and its classes' modules.
LOAD_WITHOUT_PACKAGE = """
import importlib.abc, sys

class NoPackage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] == 'channels_last_algo':
            raise ModuleNotFoundError(f'No module named {name!r}', name=name)
        return None

sys.meta_path.insert(0, NoPackage())
import torch

model_path, input_path, output_path = sys.argv[1:]
model = torch.load(model_path, weights_only=False)
loaded = sorted(name for name in sys.modules if name.partition('.')[0] == 'channels_last_algo')
classes = sorted({f'{type(m).__module__}.{type(m).__qualname__}' for m in model.modules()})
torch.save({'output': model(torch.load(input_path)), 'loaded': loaded, 'classes': classes}, output_path)
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


def test_a_saved_guarded_model_loads_and_runs_where_the_package_is_missing(tmp_path):
    model = stem_net()
    guard = LayoutGuard()
    summary = guard.on_init(model)
    guard.close()
    assert sorted(r.reason for r in summary.repaired) == ['global_avg_pool', 'shufflenet_channel_shuffle']
    assert [r.path for r in summary.made_safe] == (['stem'] if ONEDNN.affects(Runtime.current('cpu')) else [])
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)
    torch.save(model, tmp_path / 'model.pt')
    torch.save(x, tmp_path / 'input.pt')
    child = subprocess.run(
        [sys.executable, '-I', '-c', LOAD_WITHOUT_PACKAGE, 'model.pt', 'input.pt', 'output.pt'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    loaded = torch.load(tmp_path / 'output.pt', weights_only=False)
    assert loaded['loaded'] == []
    assert not [name for name in loaded['classes'] if name.startswith('channels_last_algo')]
    torch.testing.assert_close(loaded['output'], expected, rtol=1e-12, atol=1e-12)


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
