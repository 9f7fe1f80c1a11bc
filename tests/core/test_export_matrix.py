"""Every layer that channels last swaps in, through every exporter: torch.fx,
TorchScript (script and trace), torch.export and both ONNX exporters. Each export is run (an ONNX file in
onnxruntime) on a new input and compared with the NCHW model before the swap; so are a few torchvision and
timm models after ``apply_channels_last``."""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import os
import select
import signal
import traceback
import warnings

import numpy
import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.segmentation.deeplabv3 import ASPP
from torchvision.models.shufflenetv2 import InvertedResidual

from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import RULES, repair_model
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.runtime import Runtime
from channels_last_algo.core.safety.bugs import KNOWN_BUGS, make_safe

pytestmark = pytest.mark.slow  # every swapped layer through every exporter (deselect with -m 'not slow')

SHAPE = (2, 3, 8, 8)
SAFE_RUNTIMES = [Runtime((2, 7, 0), 'cpu', 'AVX512'), Runtime((2, 13, 0), 'cuda')]  # where every safe path applies


def _timm(module, name):
    """A name from a timm module (the test skips without timm)."""
    return getattr(pytest.importorskip(module), name)


def _conv(c_in, c_out):
    return nn.Conv2d(c_in, c_out, 3, padding=1)


def _between(layer, c_in=8, c_out=8):
    """Conv2d -> ``layer`` -> Conv2d, so that the layer gets an NHWC activation and hands one on."""
    return nn.Sequential(_conv(3, c_in), nn.ReLU(), layer, _conv(c_out, 4))


def _std_conv(name, **kwargs):
    return lambda: nn.Sequential(_timm('timm.layers.std_conv', name)(3, 8, 3, **kwargs), nn.ReLU(), _conv(8, 4))


# swapped-in class name -> (builder of the NCHW model, how the swap is made: 'cpu' and 'cuda' are the repair
# rules for that device, 'safe' the kernel safe paths)
CASES = {
    'ChannelsLastAdaptiveAvgPool2d': (lambda: _between(nn.AdaptiveAvgPool2d(1)), 'cpu'),
    'ChannelsLastMobileNetV2': (
        lambda: MobileNetV2(num_classes=4, width_mult=0.25, inverted_residual_setting=[[1, 8, 1, 1], [2, 8, 1, 2]]),
        'cpu',
    ),
    'ChannelsLastInvertedResidual': (
        lambda: nn.Sequential(_conv(3, 8), InvertedResidual(8, 16, 2), InvertedResidual(16, 16, 1), _conv(16, 4)),
        'cpu',
    ),
    'ChannelsLastGroupNorm': (lambda: _between(nn.GroupNorm(2, 8)), 'cuda'),
    'ChannelsLastInstanceNorm2d': (lambda: _between(nn.InstanceNorm2d(8, affine=True)), 'cpu'),
    'ChannelsLastBicubicUpsample': (lambda: _between(nn.Upsample(scale_factor=2, mode='bicubic')), 'cpu'),
    'ChannelsLastPixelShuffle': (lambda: _between(nn.PixelShuffle(2), 8, 2), 'cuda'),
    'ChannelsLastPixelUnshuffle': (lambda: _between(nn.PixelUnshuffle(2), 2, 8), 'cuda'),
    'ChannelsLastReflectionPad2d': (lambda: _between(nn.ReflectionPad2d((1, 2, 0, 1))), 'cuda'),
    'ChannelsLastReplicationPad2d': (lambda: _between(nn.ReplicationPad2d((1, 2, 0, 1))), 'cuda'),
    'ChannelsLastASPPPooling': (lambda: nn.Sequential(_conv(3, 8), ASPP(8, [2], 8)), 'cpu'),
    'ChannelsLastGhostModule': (
        lambda: _between(_timm('timm.models.ghostnet', 'GhostModule')(8, 11), 8, 11),
        'cpu',
    ),
    'ChannelsLastGhostModuleV2': (
        lambda: _between(_timm('timm.models.ghostnet', 'GhostModuleV2')(8, 11), 8, 11),
        'cpu',
    ),
    'ChannelsLastSplitAttn': (lambda: _between(_timm('timm.layers.split_attn', 'SplitAttn')(8, 8, radix=2)), 'cpu'),
    'ChannelsLastStdConv2d': (_std_conv('StdConv2d'), 'cpu'),
    'ChannelsLastStdConv2dSame': (_std_conv('StdConv2dSame', stride=2), 'cpu'),
    'ChannelsLastScaledStdConv2d': (_std_conv('ScaledStdConv2d'), 'cpu'),
    'ChannelsLastScaledStdConv2dSame': (_std_conv('ScaledStdConv2dSame', stride=2), 'cpu'),
    'SubsampledConv2d': (lambda: nn.Sequential(nn.Conv2d(3, 8, 1, stride=2), nn.ReLU(), _conv(8, 4)), 'safe'),
    'NCHWAvgPool2d': (lambda: _between(nn.AvgPool2d(3, 2, padding=1)), 'safe'),
    'NCHWMaskDropout': (lambda: _between(nn.Dropout(0.3)), 'safe'),
}


def test_cases_cover_every_swapped_in_layer():
    rules = {
        r.replacement.rpartition('.')[2] if isinstance(r.replacement, str) else r.replacement.__name__ for r in RULES
    }
    assert set(CASES) == rules | {b.replacement.__name__ for b in KNOWN_BUGS}


def _swap(model, how):
    if how == 'safe':
        apply_channels_last(model, repair=False, kernel_safety=False)
        make_safe(model, runtimes=SAFE_RUNTIMES)
    elif how == 'cuda':
        apply_channels_last(model, repair=False)
        repair_model(model, device='cuda')
    else:
        apply_channels_last(model)


def _case(name, dtype):
    """(NCHW model in eval mode, its swapped channels-last copy, NHWC input)."""
    build, how = CASES[name]
    torch.manual_seed(0)
    reference = build().to(dtype).eval()
    with torch.no_grad():
        for p in reference.parameters():
            if p.dim() == 1:  # norm weights and biases away from 1 and 0
                p.add_(torch.randn_like(p), alpha=0.2)
    model = copy.deepcopy(reference)
    x = to_channels_last(torch.randn(SHAPE, dtype=dtype))
    _swap(model, how)
    assert any(type(m).__name__ == name for m in model.modules())
    return reference, model, x


def _require_onnx(dynamo):
    """onnxruntime, after skipping where an exporter's packages are missing."""
    pytest.importorskip('onnx')
    ort = pytest.importorskip('onnxruntime')
    if dynamo:
        if 'dynamo' not in inspect.signature(torch.onnx.export).parameters:
            pytest.skip('this torch has no dynamo ONNX exporter')
        pytest.importorskip('onnxscript')
    return ort


CHILD_TIMEOUT = 600


def _in_child(fn):
    """Run ``fn()`` in a forked child process, so that a crash (the TorchScript exporter has died from
    SIGSEGV on a layer it mistranslated) fails a test instead of ending the session; what went wrong
    there, or None. onnxruntime runs only in such children: its thread pools do not survive a fork."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        # Garbage inherited from earlier tests (a gloo process group) must not be collected here: its
        # destructor waits on threads the fork did not copy, and the child would hang.
        gc.disable()
        try:
            torch.set_num_threads(1)  # nor does OpenMP's
            torch.cuda.is_available = lambda: False  # nor CUDA (the exports run on the CPU)
            fn()
        except BaseException:
            os.write(write, traceback.format_exc().encode())
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        if not select.select([pipe], [], [], CHILD_TIMEOUT)[0]:  # a hang guard, far beyond any export here
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f'the process hung for {CHILD_TIMEOUT} s and was killed'
        error = pipe.read()
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        return f'the process crashed ({signal.Signals(os.WTERMSIG(status)).name})'
    return error or None


def _onnx_outputs(model, x, new, path, dynamo):
    """Export ``model`` with ``x`` to ONNX and run the file in onnxruntime on ``new``: its outputs, or
    what went wrong (a string)."""
    ort = _require_onnx(dynamo)

    def export_and_run():
        torch.onnx.export(model, (x,), str(path), dynamo=dynamo)
        session = ort.InferenceSession(str(path), providers=['CPUExecutionProvider'])
        numpy.savez(
            path.with_suffix('.npz'), *session.run(None, {session.get_inputs()[0].name: new.contiguous().numpy()})
        )

    error = _in_child(export_and_run)
    if error is not None:
        return f'torch.onnx.export(dynamo={dynamo}) and onnxruntime: {error}'
    with numpy.load(path.with_suffix('.npz')) as outputs:
        return [torch.from_numpy(outputs[f'arr_{i}']) for i in range(len(outputs.files))]


def _onnx(model, x, new, path, dynamo):
    outputs = _onnx_outputs(model, x, new, path, dynamo)
    if isinstance(outputs, str):
        pytest.fail(outputs, pytrace=False)
    return outputs[0]


# exporter -> f(model, example input, new input, ONNX file): the export's output for the new input
EXPORTERS = {
    'fx': lambda model, x, new, path: torch.fx.symbolic_trace(model)(new),
    'script': lambda model, x, new, path: torch.jit.script(model)(new),
    'trace': lambda model, x, new, path: torch.jit.trace(model, (x,))(new),
    'export': lambda model, x, new, path: torch.export.export(model, (x,)).module()(new),
    'onnx': functools.partial(_onnx, dynamo=False),
    'onnx_dynamo': functools.partial(_onnx, dynamo=True),
}
ONNX_EXPORTERS = ('onnx', 'onnx_dynamo')


def _assert_close(actual, expected, exporter):
    tolerance = dict(rtol=1e-4, atol=1e-5) if exporter in ONNX_EXPORTERS else dict(rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(actual, expected, **tolerance)


@pytest.fixture(autouse=True)
def _quiet_and_fresh():
    """Without the exporters' deprecation notices and tracer warnings, and with dynamo's caches emptied:
    torch.export (strict by default up to torch 2.8) compiles ``Sequential.forward`` for every case, and
    past the recompile limit it would refuse the next one."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        yield


def _assert_exported_matches(reference, model, x, exporter, path):
    """Export ``model`` with ``x``, run the export on a new input: the NCHW reference's outputs."""
    new = to_channels_last(torch.randn(x.shape, dtype=x.dtype))
    with torch.no_grad():
        expected = reference(new.contiguous())
        _assert_close(EXPORTERS[exporter](model, x, new, path), expected, exporter)


class _SideBySide(nn.Module):
    """Several models applied to one input, for one export of all of them."""

    def __init__(self, models):
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x):
        return [model(x) for model in self.models]


def _dynamo_side_by_side(build, names, shape, path):
    """{name: (expected, actual)} for the (NCHW reference, swapped model) pairs that ``build(name)`` makes,
    from one export of the swapped models side by side with the dynamo exporter, which takes about a second
    a call whatever the model's size; empty if that export failed (each test then exports its model alone,
    to tell which)."""
    _require_onnx(dynamo=True)
    pairs = {}
    for name in names:
        try:
            pairs[name] = build(name)
        except pytest.skip.Exception:  # timm is missing: the test skips on its own
            continue
    x, new = (to_channels_last(torch.randn(shape)) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        outputs = _onnx_outputs(_SideBySide([model for _, model in pairs.values()]), x, new, path, dynamo=True)
    if isinstance(outputs, str):
        return {}
    with torch.no_grad():
        expected = [reference(new.contiguous()) for reference, _ in pairs.values()]
    return dict(zip(pairs, zip(expected, outputs)))


@pytest.fixture(scope='module')
def dynamo_layers(tmp_path_factory):
    return _dynamo_side_by_side(
        lambda name: _case(name, torch.float32)[:2], CASES, SHAPE, tmp_path_factory.mktemp('layers') / 'model.onnx'
    )


@pytest.mark.parametrize('exporter', EXPORTERS)
@pytest.mark.parametrize('layer', CASES)
def test_swapped_layer_exports_and_runs_with_the_nchw_numbers(layer, exporter, tmp_path, request):
    """float64 through fx, TorchScript and torch.export; float32 through ONNX and onnxruntime."""
    onnx = exporter in ONNX_EXPORTERS
    reference, model, x = _case(layer, torch.float32 if onnx else torch.float64)
    if exporter == 'onnx_dynamo' and layer in request.getfixturevalue('dynamo_layers'):
        _assert_close(*request.getfixturevalue('dynamo_layers')[layer], exporter)
    else:
        _assert_exported_matches(reference, model, x, exporter, tmp_path / 'model.onnx')


ZOO = [
    'resnet18',
    'mobilenet_v3_small',
    'shufflenet_v2_x0_5',
    'efficientnet_b0',
    'timm/ghostnet_050',
    'timm/resnest14d',
]
ZOO_SHAPE = (1, 3, 32, 32)


def _zoo(name):
    """(NCHW model in eval mode, its copy after ``apply_channels_last``)."""
    torch.manual_seed(0)
    if name.startswith('timm/'):
        reference = _timm('timm', 'create_model')(name[5:], pretrained=False, num_classes=10)
    else:
        reference = torchvision.models.get_model(name, weights=None, num_classes=10)
    model = copy.deepcopy(reference.eval())
    assert apply_channels_last(model).repaired
    return reference, model


@pytest.fixture(scope='module')
def dynamo_zoo(tmp_path_factory):
    return _dynamo_side_by_side(_zoo, ZOO, ZOO_SHAPE, tmp_path_factory.mktemp('zoo') / 'model.onnx')


@pytest.mark.parametrize('exporter', ONNX_EXPORTERS)
@pytest.mark.parametrize('name', ZOO)
def test_zoo_model_exports_to_onnx_with_the_nchw_numbers(name, exporter, tmp_path, request):
    reference, model = _zoo(name)
    if exporter == 'onnx_dynamo' and name in request.getfixturevalue('dynamo_zoo'):
        _assert_close(*request.getfixturevalue('dynamo_zoo')[name], exporter)
    else:
        x = to_channels_last(torch.randn(ZOO_SHAPE))
        _assert_exported_matches(reference, model, x, exporter, tmp_path / 'model.onnx')
