"""Fused inference of convolutions that are not a plain ``nn.Conv2d`` call: subclasses keeping its forward,
``'same'`` padding, functional calls, weights computed from parameters (weight standardization), parametrized
weights, padding computed from the input's shape, and the convolutions inside modules that fx calls whole."""

import pytest
import torch
import torch.nn.functional as F
from same_padding import pad_same
from test_fuse import _randomize_batchnorm, _relative_error
from torch import nn
from torch.nn.utils import parametrizations

from channels_last_algo import fuse_for_inference
from channels_last_algo.core.fuse.graph import trace


def _fused_and_checked(model, sizes=(12, 7)):
    """The summary of ``model``'s fused copy, checked against ``model`` at several sizes."""
    model = _randomize_batchnorm(model).eval()
    fused = fuse_for_inference(model, torch.randn(2, 3, sizes[0], sizes[0]))
    with torch.no_grad():
        for size in sizes:
            images = torch.randn(3, 3, size, size)
            assert _relative_error(fused(images), model(images)) < 1e-5
    return fused.summary


class _Depthwise(nn.Conv2d):
    """A subclass adding nothing to the math (as transformers' ``EfficientNetDepthwiseConv2d``)."""

    def __init__(self, channels):
        super().__init__(channels, channels, 3, padding='same', groups=channels, bias=False)


class _PaddedByName(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 8, 3, padding='valid'), nn.BatchNorm2d(8), nn.SiLU()
        self.depthwise, self.depthwise_bn = _Depthwise(8), nn.BatchNorm2d(8)
        self.even = nn.Conv2d(8, 4, 2, padding='same')  # pads one more on the right: no integer padding says so

    def forward(self, x):
        x = self.act(self.bn(self.conv(x)))
        return self.even(torch.relu(self.depthwise_bn(self.depthwise(x))))


def test_subclasses_keeping_the_forward_and_padding_by_name_fold_and_fuse():
    summary = _fused_and_checked(_PaddedByName())
    assert summary.fused == {'conv': 'conv+bn+silu', 'depthwise': 'conv+bn+relu'}
    assert summary.unfused == []


class _StandardizedConv(nn.Conv2d):
    """Weight standardization, as timm's ``StdConv2d`` and BiT's ``WeightStandardizedConv2d``."""

    def forward(self, x):
        weight = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0, eps=1e-6
        ).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class _SamePadded(nn.Conv2d):
    """Pads, then convolves with no padding (timm's ``Conv2dSame`` computes the padding from the shape)."""

    def forward(self, x):
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


def test_functional_convolutions_on_computed_weights_are_computed_once_and_fused():
    model = nn.Sequential(
        _StandardizedConv(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), _SamePadded(8, 8, 3), nn.BatchNorm2d(8)
    )
    summary = _fused_and_checked(model)
    assert summary.fused == {'0.conv2d': 'conv+bn+relu', '3.conv2d': 'conv+bn'}
    assert summary.unfused == []  # the standardization's batch_norm is not a BatchNorm of the network
    graph = trace(model).graph
    assert not [node for node in graph.nodes if node.target in (torch.conv2d, F.batch_norm)]


class _Noisy(nn.Conv2d):
    def forward(self, x):
        return F.conv2d(x, self.weight + 1e-3 * torch.randn_like(self.weight), self.bias, padding=1)


class _Observed(nn.Conv2d):
    """Scales its weight by its input's range, kept in a buffer (as a quantization observer)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer('range', torch.ones(()))

    def forward(self, x):
        self.range.copy_(x.detach().abs().amax())
        return F.conv2d(x, self.weight / self.range, self.bias, padding=1)


class _Accumulated(_Observed):
    """Adds its input's mean to the buffer its weight is scaled by, through a view (``+=`` on a proxy:
    ``operator.iadd``)."""

    def forward(self, x):
        total = self.range.view(1)
        total += x.detach().mean()
        return F.conv2d(x, self.weight * self.range, self.bias, padding=1)


@pytest.mark.parametrize('conv', [_Noisy, _Observed, _Accumulated], ids=['random', 'written', 'added to'])
def test_weights_that_change_between_calls_stay_functional_calls(conv):
    graph = trace(nn.Sequential(conv(3, 8, 3), nn.ReLU())).graph
    assert [node for node in graph.nodes if node.target is torch.conv2d]
    assert not [node for node in graph.nodes if node.op == 'call_module' and node.target.startswith('0')]


def test_a_parametrized_convolution_folds_its_batchnorm():
    model = nn.Sequential(parametrizations.weight_norm(nn.Conv2d(3, 8, 3, padding=1)), nn.BatchNorm2d(8), nn.ReLU())
    assert _fused_and_checked(model).fused == {'0': 'conv+bn+relu'}


class _ConvBnRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class _ChecksChannels(nn.Module):
    """Checks its input first, as transformers' patch embeddings do: fx calls it whole."""

    def __init__(self):
        super().__init__()
        self.embed = _ConvBnRelu()

    def forward(self, x):
        if x.shape[1] != 3:
            raise ValueError('expected 3 channels')
        return self.embed(x)


def test_modules_fx_calls_whole_are_fused_inside_by_the_module_route():
    model = nn.Sequential(_ChecksChannels(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
    summary = _fused_and_checked(model)
    assert summary.route == 'fx'
    assert summary.fused == {'1': 'conv+bn', '0.embed.conv': 'conv+bn+relu'}
    assert summary.unfused == []


class _TensorFlowSame(nn.Module):
    """A strided convolution padded as TensorFlow's ``'SAME'``, from the input's shape (as transformers'
    ``MobileNetV2ConvLayer`` and timm's ``Conv2dSame``), then its BatchNorm and ReLU6."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(cin, cout, 3, stride=2), nn.BatchNorm2d(cout), nn.ReLU6()

    def forward(self, x):
        return self.act(self.bn(self.conv(pad_same(x, 3, 2))))


class _DecidesOnValues(nn.Module):
    """fx cannot trace its own forward: the module route is taken."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _TensorFlowSame(3, 8), _TensorFlowSame(8, 8)

    def forward(self, x):
        x = self.first(x)
        return self.second(x) if x.sum() > -1e9 else x


@pytest.mark.parametrize(
    'model, route',
    [(lambda: nn.Sequential(_TensorFlowSame(3, 8), _TensorFlowSame(8, 8)), 'fx'), (_DecidesOnValues, 'modules')],
    ids=['fx', 'modules'],
)
def test_padding_computed_from_the_shape_runs_whole_and_the_convolutions_fuse(model, route):
    summary = _fused_and_checked(model(), sizes=(12, 7, 9))  # odd sizes pad one side more
    assert summary.route == route
    prefixes = ('0', '1') if route == 'fx' else ('first', 'second')
    assert summary.fused == {f'{prefix}.conv': 'conv+bn+relu6' for prefix in prefixes}


class _Conv3DSimple(nn.Conv3d):
    """A subclass setting its arguments only (torchvision's video ResNets): fx traces into it."""

    def __init__(self, cin, cout):
        super().__init__(cin, cout, (3, 3, 3), padding=(1, 1, 1), bias=False)


def test_a_conv3d_folds_its_batchnorm_and_stays_a_channels_last_3d_convolution():
    model = nn.Sequential(_Conv3DSimple(3, 8), nn.BatchNorm3d(8), nn.ReLU(), nn.Conv3d(8, 4, 1), nn.BatchNorm3d(4))
    with torch.no_grad():
        for bn in (model[1], model[4]):
            bn.running_mean.uniform_(-0.5, 0.5), bn.running_var.uniform_(0.5, 2.0)
    model.eval()
    fused = fuse_for_inference(model, torch.randn(2, 3, 4, 6, 6))
    assert fused.summary.fused == {'0': 'conv3d+bn', '3': 'conv3d+bn'} and fused.summary.unfused == []
    folded = fused.module.get_submodule('0')
    assert isinstance(folded, nn.Conv3d) and folded.weight.is_contiguous(memory_format=torch.channels_last_3d)
    with torch.no_grad():
        for shape in ((2, 3, 4, 6, 6), (1, 3, 5, 7, 3)):
            clip = torch.randn(shape)
            assert _relative_error(fused(clip), model(clip)) < 1e-5


class _MixedKernels(nn.Module):
    """timm's ``MixedConv2d``: the channels split, a convolution of each kernel size, concatenated; then
    its BatchNorm and activation (``reuse``: the concatenation is read again, so nothing folds)."""

    def __init__(self, reuse=False):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(4, 2, 3, padding=1), nn.Conv2d(4, 6, 5, padding=2, bias=False)])
        self.bn, self.reuse = nn.BatchNorm2d(8), reuse

    def forward(self, x):
        parts = torch.split(x, [4, 4], 1)
        mixed = torch.cat([conv(parts[index]) for index, conv in enumerate(self.convs)], 1)
        torch._assert(mixed.ndim == 4, 'a 4D input')  # a read of its rank, as timm's BatchNormAct2d makes
        y = torch.relu(self.bn(mixed))
        return y + mixed if self.reuse else y


@pytest.mark.parametrize('reuse', [False, True], ids=['folded', 'read again'])
def test_a_batchnorm_after_concatenated_convolutions_folds_slice_by_slice(reuse):
    model = _randomize_batchnorm(_MixedKernels(reuse)).eval()
    x = torch.randn(2, 8, 9, 9)
    fused = fuse_for_inference(model, x)
    if reuse:
        assert fused.summary.unfused == ['bn'] and 'conv+bn' not in fused.summary.fused.values()
    else:
        assert fused.summary.fused == {'convs.0': 'conv+bn', 'convs.1': 'conv+bn'}
        assert fused.summary.split == {'bn': ['convs.0', 'convs.1']} and fused.summary.unfused == []
        assert str(fused.summary).startswith('fx: 2 convolutions fused, 1 of 1 BatchNorms folded')
    with torch.no_grad():
        for size in (9, 6):
            images = torch.randn(3, 8, size, size)
            assert _relative_error(fused(images), model(images)) < 1e-5


class _TiedDecoder(nn.Module):
    """An encoder convolution and BatchNorm, and a decoder that reads the encoder's weight (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose2d(self.enc(x), self.enc[0].weight, padding=1)


class _NormalizedByWeight(nn.Module):
    """Outputs divided by each filter's norm, read from the convolution's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.conv.weight.flatten(1).norm(dim=1)[None, :, None, None]
        return self.head(self.bn(self.conv(x)) / scale)


class _ReadInsideAWholeModule(nn.Module):
    """A forward fx cannot trace (it decides on a value) around a tied block: the module route fuses inside."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _TiedDecoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y if float(y.abs().max()) < 1e9 else y / 2


@pytest.mark.parametrize(
    'model,read',
    [(_TiedDecoder, 'enc.0'), (_NormalizedByWeight, 'conv'), (_ReadInsideAWholeModule, 'block.enc.0')],
    ids=['tied decoder', 'weight norm', 'module route'],
)
def test_a_convolution_whose_weight_the_forward_reads_keeps_it_unfolded(model, read):
    """Folding the BatchNorm would change the weight for its other reader too: without an example input (no
    check runs) the copy must still compute what the model does."""
    torch.manual_seed(0)
    model = _randomize_batchnorm(model()).eval()
    fused = fuse_for_inference(model)
    with torch.no_grad():
        for size in (8, 5):
            images = torch.randn(2, 3, size, size)
            assert _relative_error(fused(images), model(images)) < 1e-5
    assert read not in fused.summary.fused


class _TiedReconstructionError(_TiedDecoder):
    """The tied decoder's error, viewed: a map that the transposed convolution's channels-last weight lays out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) - x).view(x.size(0), -1).pow(2).mean(1)


@pytest.mark.parametrize('example', [False, True], ids=['no example', 'example'])
def test_a_view_of_a_map_no_module_makes_runs_on_every_call(example):
    """The copy's first call (the example check's, or the first real one) finds no module to make the viewed map
    channels first: every later call is watched too, and computes what the model does."""
    torch.manual_seed(0)
    model = _randomize_batchnorm(_TiedReconstructionError()).eval()
    images = torch.randn(2, 3, 8, 8)
    with pytest.warns(UserWarning, match='each call of the copy is watched'):
        fused = fuse_for_inference(model, images if example else None)
        with torch.no_grad():
            fused(images)
    with torch.no_grad():
        for size in (8, 6, 8):
            x = torch.randn(3, 3, size, size)
            assert _relative_error(fused(x), model(x)) < 1e-5
