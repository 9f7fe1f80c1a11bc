"""Fused NHWC inference: the zoo matches eager NCHW, the pattern table drives both routes, the
contract holds, export works at every size, the inductor backend compiles, Composer evaluates fused."""

import copy
import pickle
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import (
    FusedConv2d,
    InferenceModel,
    apply_channels_last,
    export_for_inference,
    fuse_for_inference,
)
from channels_last_algo.app.cli.entry import main
from channels_last_algo.app.recipes.models import build_model
from channels_last_algo.app.runs.demo import TinyResNet
from channels_last_algo.core.argument_checks import ExampleInputError
from channels_last_algo.core.fuse import FUSION_PATTERNS, FusedEvaluation, PostOp, patterns
from channels_last_algo.core.fuse.graph import fuse_graph, trace
from channels_last_algo.core.fuse.modules import fuse_modules
from channels_last_algo.core.layout import has_channels_last_strides

# model -> (convolutions fused, BatchNorms folded, residual adds fused, adds written in place)
ZOO = {
    'resnet50': (53, 53, 16, 16),
    'resnext50_32x4d': (53, 53, 16, 16),
    'wide_resnet50_2': (53, 53, 16, 16),
    'densenet121': (120, 59, 0, 0),  # pre-activation BN -> ReLU -> conv: only conv -> BN pairs fold
    'efficientnet_b0': (81, 49, 9, 9),  # squeeze-excitation 1x1 convs have no BatchNorm
    'mobilenet_v2': (52, 52, 10, 10),
    'mobilenet_v3_large': (62, 46, 10, 10),
    'shufflenet_v2_x1_0': (56, 56, 0, 0),
    'squeezenet1_1': (26, 0, 0, 0),
    'googlenet': (57, 57, 0, 0),
    'vgg11_bn': (8, 8, 0, 0),
    'mnasnet1_0': (52, 52, 10, 10),
    'regnet_y_400mf': (85, 53, 16, 16),
    'convnext_tiny': (22, 0, 0, 0),  # depthwise conv -> permute -> LayerNorm: nothing to fold
}


def _relative_error(actual, expected):
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _randomize_batchnorm(model, seed=0):
    """Running statistics and affine parameters far from their initial values, so folding matters."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.running_mean.copy_(torch.rand(size, generator=generator) - 0.5)
                module.running_var.copy_(torch.rand(size, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.copy_(torch.rand(size, generator=generator) * 0.4 - 0.2)
    return model


@pytest.mark.slow
@pytest.mark.parametrize('name', list(ZOO))
def test_zoo_matches_eager_nchw_and_leaves_the_model_alone(name):
    torch.manual_seed(0)
    model = _randomize_batchnorm(build_model(name, num_classes=10)).eval()
    before = {key: value.clone() for key, value in model.state_dict().items()}
    strides = {key: value.stride() for key, value in model.state_dict().items()}
    x = torch.randn(2, 3, 64, 64)

    fused = fuse_for_inference(model)
    with torch.no_grad():
        expected, actual = model(x), fused(x)

    assert _relative_error(actual, expected) < 1e-4
    summary = fused.summary
    in_place = sum(module.add_in_place for module in fused.modules() if isinstance(module, FusedConv2d))
    counts = (len(summary.fused), summary.count('bn'), summary.count('add'), in_place)
    assert summary.route == 'fx' and counts == ZOO[name]
    assert all(has_channels_last_strides(m.weight) for m in fused.modules() if isinstance(m, FusedConv2d))
    assert not any(p.requires_grad for p in fused.parameters())
    for key, value in model.state_dict().items():  # the training model: same values, same (NCHW) strides
        assert torch.equal(value, before[key]) and value.stride() == strides[key], key
    assert all(p.requires_grad for p in model.parameters())


ACTIVATIONS = [
    None,
    PostOp('relu'),
    PostOp('hardtanh', (0.0, 6.0)),
    PostOp('swish'),
    PostOp('hardswish'),
    PostOp('sigmoid'),
    PostOp('hardsigmoid'),
    PostOp('tanh'),
    PostOp('gelu', algorithm='none'),
    PostOp('gelu', algorithm='tanh'),
    PostOp('leaky_relu', (0.1,)),
]


@pytest.mark.parametrize('prepack', [True, False])
@pytest.mark.parametrize('post_op', ACTIVATIONS, ids=str)
def test_fused_convolution_matches_conv_then_activation(post_op, prepack):
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2)
    fused = FusedConv2d(conv, post_op, prepack=prepack)
    x = torch.randn(2, 8, 15, 15)
    with torch.no_grad():
        expected = conv(x) if post_op is None else post_op.eager(conv(x))
        torch.testing.assert_close(fused(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused(torch.randn(3, 8, 9, 9)).shape, torch.Size([3, 16, 5, 5]))  # other shape


@pytest.mark.parametrize('in_place', [False, True])
@pytest.mark.parametrize('post_op', [None, PostOp('relu')], ids=str)
def test_fused_residual_add(post_op, in_place):
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 1)
    fused = FusedConv2d(conv, post_op, add=True)
    fused.add_in_place = in_place
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    other = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = conv(x) + other
        expected = expected if post_op is None else torch.relu(expected)
        out = fused(x, other.clone() if not in_place else other)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out.data_ptr() == other.data_ptr()) == in_place


def test_fused_convolution_falls_back_to_eager_ops_where_onednn_does_not_apply():
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1).double()
    fused = FusedConv2d(conv, PostOp('relu'), add=True)
    x, other = torch.randn(2, 4, 5, 5, dtype=torch.float64), torch.randn(2, 4, 5, 5, dtype=torch.float64)
    with torch.no_grad():  # float64: the eager ops, agreeing to float64 rounding
        torch.testing.assert_close(fused(x, other), torch.relu(conv(x) + other), rtol=1e-12, atol=1e-12)
        broadcast = torch.randn(1, 4, 1, 1, dtype=torch.float64)  # not the output's shape: no fused add
        torch.testing.assert_close(fused(x, broadcast), torch.relu(conv(x) + broadcast), rtol=1e-12, atol=1e-12)
    x.requires_grad_()
    fused(x, other).sum().backward()  # an input needing a gradient gets the differentiable eager ops
    assert x.grad is not None


def test_a_refused_shape_runs_the_plain_ops_from_then_on(monkeypatch):
    """Where oneDNN refuses a shape (torch 2.7: conv + add with a 1 x 1 output), that call and
    later ones at the shape compute the plain ops; other shapes keep the fused kernel."""
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 8, 3, padding=1)
    fused = FusedConv2d(conv, PostOp('relu'), add=True)
    calls = []

    def refuse_one_by_one(x, other, dtype):
        calls.append(tuple(x.shape))
        if x.shape[-1] == 1:
            raise RuntimeError('could not create a memory')
        return torch.relu(nn.functional.conv2d(x, fused.weight, fused.bias, padding=1) + other)

    monkeypatch.setattr(fused, '_onednn', refuse_one_by_one)
    with torch.no_grad():
        for size in (1, 1, 4):
            x, other = torch.randn(2, 8, size, size), torch.randn(2, 8, size, size)
            torch.testing.assert_close(fused(x, other), torch.relu(conv(x) + other), rtol=1e-5, atol=1e-5)
    assert calls == [(2, 8, 1, 1), (2, 8, 4, 4)]  # tried once at 1 x 1
    assert fused.refused == {('cpu', torch.float32, (8, 1, 1))}


@pytest.mark.parametrize('size', [8, 16, 32])
def test_fused_copy_and_export_at_small_sizes(size, tmp_path):
    """ResNet-18 at 8-32 px: the last stages are 1 x 1, where torch 2.7's oneDNN refuses conv + add."""
    torch.manual_seed(0)
    model = _randomize_batchnorm(build_model('resnet18', num_classes=10)).eval()
    x, other_batch = torch.randn(2, 3, size, size), torch.randn(3, 3, size, size)
    with warnings.catch_warnings():  # prepacked weights leave no 4D tensor: nothing to warn the user about
        warnings.simplefilter('error')
        fused = fuse_for_inference(model, x)
    _, summary = export_for_inference(model, tmp_path / 'resnet18.pt2', x)
    program = torch.export.load(tmp_path / 'resnet18.pt2').module()
    with torch.no_grad():
        assert _relative_error(fused(other_batch), model(other_batch)) < 1e-4
        nhwc = other_batch.to(memory_format=torch.channels_last)
        assert _relative_error(program(nhwc), model(other_batch)) < 1e-4
    assert summary.count('add') == 8 and set(summary.refused) <= {p for p, k in summary.fused.items() if 'add' in k}


def test_both_routes_read_the_pattern_table(monkeypatch):
    """The same patterns on both routes; a pattern taken out of the table is gone from both."""

    def model():
        torch.manual_seed(0)
        return _randomize_batchnorm(
            nn.Sequential(
                nn.Conv2d(3, 8, 3),
                nn.BatchNorm2d(8),
                nn.ReLU6(),
                nn.Conv2d(8, 8, 1),
                nn.Dropout(),
                nn.BatchNorm2d(8),
                nn.SiLU(),
                nn.Conv2d(8, 4, 1),
                nn.Hardswish(),
                nn.Conv2d(4, 4, 1),
            )
        ).eval()

    def both_routes():
        graph_module = trace(model())
        return fuse_graph(graph_module, prepack=True).fused, fuse_modules(model(), prepack=True).fused

    graph, modules = both_routes()
    assert graph == modules == {'0': 'conv+bn+relu6', '3': 'conv+bn+silu', '7': 'conv+hardswish', '9': 'conv'}
    monkeypatch.setattr(
        patterns,
        'FUSION_PATTERNS',
        {pattern: fuser for pattern, fuser in FUSION_PATTERNS.items() if patterns.ACTIVATION not in pattern},
    )
    graph, modules = both_routes()
    assert graph == modules == {'0': 'conv+bn', '3': 'conv+bn', '7': 'conv', '9': 'conv'}


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + y)


def test_inductor_backend_compiles_the_fused_copy_with_freezing():
    model = _randomize_batchnorm(_Residual()).eval()
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x, backend='inductor')
    assert fused.summary.backend == 'inductor' and str(fused.summary).endswith('compiled by inductor (freezing)')
    assert fused.summary.fused == {'conv1': 'conv+bn+relu', 'conv2': 'conv+bn+add+relu'}
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5
    with pytest.raises(ValueError, match=r"backend must be one of \('eager', 'inductor'\), got 'tvm'"):
        fuse_for_inference(model, backend='tvm')
    with pytest.raises(ValueError, match=r"traceable=True \(a copy for torch.export\) needs backend='eager'"):
        fuse_for_inference(model, traceable=True, backend='inductor')


def test_a_model_in_train_mode_is_refused_naming_the_submodule():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r'Sequential in eval mode, but it is in train mode.*model.eval\(\)'):
        fuse_for_inference(model)
    model.eval()
    model[1].train()
    with pytest.raises(ValueError, match=r"submodule '1' \(BatchNorm2d\) is in train mode"):
        fuse_for_inference(model)


def test_a_torchscript_model_is_refused_naming_what_to_pass():
    model = torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).eval())
    with pytest.raises(
        ValueError, match=r'the model is TorchScript \(RecursiveScriptModule.*the nn.Module it was made'
    ):
        fuse_for_inference(model)


def test_the_copy_refuses_train_mode_and_inputs_needing_grad():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(16, 2)).eval()
    fused = fuse_for_inference(model)
    assert isinstance(fused, InferenceModel) and not fused.training
    x = torch.randn(2, 3, 4, 4)
    fused.train()
    with pytest.raises(RuntimeError, match='in train mode; it is eval-only'):
        fused(x)
    fused.eval()
    with pytest.raises(RuntimeError, match='requires grad; it has no backward'):
        fused(x.requires_grad_())
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-5)
    fused(x.detach())  # grad mode on is fine when nothing asks for a gradient


class _BatchNormAct(nn.BatchNorm2d):
    """timm's ``BatchNormAct2d``: a functional ``batch_norm`` on its own statistics after a check of the
    input's rank, then its dropout and activation children."""

    def __init__(self, channels):
        super().__init__(channels)
        self.drop, self.act = nn.Identity(), nn.SiLU()

    def forward(self, x):
        torch._assert(x.ndim == 4, f'expected 4D input (got {x.ndim}D input)')
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return self.act(self.drop(x))


def test_fx_route_folds_functional_batchnorms_on_a_modules_own_statistics():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _BatchNormAct(8), nn.Conv2d(8, 4, 1), _BatchNormAct(4))
    model = _randomize_batchnorm(model).eval()
    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    fused = fuse_for_inference(model, x)
    assert fused.summary.route == 'fx' and fused.summary.unfused == []
    assert fused.summary.fused == {'0': 'conv+bn+silu', '2': 'conv+bn+silu'}
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5


def test_fx_route_names_the_functional_batchnorms_it_leaves():
    """A BatchNorm before its convolution (pre-activation) stays, named by its module."""
    model = _randomize_batchnorm(nn.Sequential(_BatchNormAct(3), nn.Conv2d(3, 4, 3))).eval()
    summary = fuse_for_inference(model, torch.randn(2, 3, 8, 8)).summary
    assert summary.unfused == ['0'] and summary.fused == {'1': 'conv'}


def test_timm_batchnorm_act_layers_fold():
    timm = pytest.importorskip('timm')
    model = _randomize_batchnorm(timm.create_model('regnetx_002', pretrained=False, num_classes=10)).eval()
    x = torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    fused = fuse_for_inference(model, x)
    assert fused.summary.route == 'fx' and fused.summary.unfused == [] and fused.summary.count('bn') == 44
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-4


class _DataDependent(nn.Module):
    """Control flow on a tensor value: symbolic tracing fails."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Hardswish(), nn.Conv2d(8, 8, 1), nn.ReLU6()
        )
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        x = self.features(x)
        return self.head(x) if x.sum() > 0 else -self.head(x)


class _TracesWrong(nn.Module):
    """``isinstance(x, Tensor)`` is False for a tracing proxy: the traced graph drops a branch."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            x = x * 2
        return self.body(x)


class _TracesIntoAnError(nn.Module):
    """A decoder block whose skip connection is concatenated only ``if isinstance(skip, Tensor)`` (MONAI's
    ``UpCat``): the traced graph drops the concatenation, and its convolution refuses the channels left."""

    def __init__(self):
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.up = nn.Sequential(nn.Conv2d(7, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        skip, y = x, self.down(x)
        if isinstance(skip, torch.Tensor):
            y = torch.cat([y, skip], dim=1)
        return self.up(y)


def test_module_route_when_tracing_fails():
    model = _randomize_batchnorm(_DataDependent()).eval()
    fused = fuse_for_inference(model)
    summary = fused.summary
    assert summary.route == 'modules' and 'TraceError' in summary.trace_error
    assert summary.fused == {'features.0': 'conv+bn+hardswish', 'features.3': 'conv+relu6', 'head': 'conv'}
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5


class _ConvBnAct(nn.Module):
    """A conv block whose forward calls its children in turn (``self.act(self.bn(self.conv(x)))``, as
    YOLO's ``Conv``), with one activation instance shared by every block, and an attribute it sets."""

    shared_act = nn.SiLU()

    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.bn, self.act = (
            nn.Conv2d(cin, cout, 3, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            self.shared_act,
        )

    def forward(self, x):
        self.width = x.shape[-1]  # under tracing, a proxy: set on a copy of the block, never on it
        return self.act(self.bn(self.conv(x)))


class _TwiceRelu(nn.Module):
    """torchvision's BasicBlock: one ReLU called twice, so it is absorbed by neither run."""

    def __init__(self, channels):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + x)


class _UntraceableRoot(nn.Module):
    """Blocks in a ``ModuleList`` that a data-dependent forward calls: the model does not trace, its
    blocks' forwards do."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ConvBnAct(3, 8), _TwiceRelu(8), _ConvBnAct(8, 4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x) if x.sum() > -1e9 else x
        return x


def test_module_route_fuses_the_runs_each_forward_calls():
    """With no example input to check graphs on, the blocks keep their own forwards (see the test after)."""
    model = _randomize_batchnorm(_UntraceableRoot()).eval()
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model)
    summary = fused.summary
    assert summary.route == 'modules' and summary.unfused == [] and summary.graphs == []
    assert summary.fused == {
        'blocks.0.conv': 'conv+bn+silu',
        'blocks.1.conv1': 'conv+bn',
        'blocks.1.conv2': 'conv+bn',
        'blocks.2.conv': 'conv+bn+silu',
    }
    assert isinstance(model.blocks[0].act, nn.SiLU) and isinstance(model.blocks[0].bn, nn.BatchNorm2d)
    blocks = fused.module.blocks
    assert isinstance(blocks[0].act, nn.Identity) and isinstance(_ConvBnAct.shared_act, nn.SiLU)  # a slot, not it
    assert not any(isinstance(v, torch.fx.Proxy) for m in fused.modules() for v in vars(m).values())
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5


class _TwiceReluWithChannels(_TwiceRelu):
    @property
    def channels(self):
        return self.conv1.out_channels


class _BlocksWithAProperty(nn.Module):
    """A forward that branches on an argument (transformers' ``return_dict``): the model does not trace, its
    blocks do; it reads a property of a block, which a graph in the block's place would not have."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_ConvBnAct(3, 8), _TwiceReluWithChannels(8), _ConvBnAct(8, 4)])

    def forward(self, x, flip=False):
        for block in self.blocks:
            x = block(x)
        return x.flip(-1) if flip else x * self.blocks[1].channels


def test_module_route_runs_the_fused_graphs_of_the_blocks_that_trace_as_their_forwards():
    model = _randomize_batchnorm(_BlocksWithAProperty()).eval()
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x)
    summary = fused.summary
    assert summary.route == 'modules' and summary.graphs == ['blocks.0', 'blocks.1', 'blocks.2']
    assert summary.unfused == [] and summary.count('add') == 1
    assert summary.fused['blocks.1.conv1'] == 'conv+bn+relu'  # one ReLU called twice, fused into both
    assert summary.fused['blocks.1.conv2'] == 'conv+bn+add+relu'
    block = fused.module.blocks[1]
    assert type(block) is _TwiceReluWithChannels and block.channels == 8  # the same object, class and property
    assert isinstance(block.conv2, FusedConv2d) and isinstance(block.bn2, nn.Identity)
    assert isinstance(model.blocks[1].bn2, nn.BatchNorm2d) and 'forward' not in vars(model.blocks[1])
    assert not any(isinstance(v, torch.fx.Proxy) for m in fused.modules() for v in vars(m).values())
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5
        assert _relative_error(fused(x, True), model(x, True)) < 1e-5
        for copied in (copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):  # each runs its own graphs
            assert _relative_error(copied(x), model(x)) < 1e-5 and copied.module.blocks[1].forward.module is not block
    assert '1 with a residual add; 3 submodules fused on their traced graphs' in str(summary)


class _CallsAGrandchild(_UntraceableRoot):
    """A forward that calls a block's BatchNorm itself: the run in the block cannot absorb it."""

    def forward(self, x):
        y = super().forward(x)
        return y + self.blocks[2].bn(y)


def test_module_route_without_the_runs_where_other_code_calls_their_children():
    model = _randomize_batchnorm(_CallsAGrandchild()).eval()
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x)
    assert fused.summary.fused['blocks.0.conv'] == 'conv' and 'blocks.2.bn' in fused.summary.unfused
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5


class _Swish(nn.Module):
    """An activation from outside torch.nn, its forward one functional call (transformers' ``SiLUActivation``)."""

    def forward(self, x):
        return F.silu(x)


class _Doubles(nn.Module):
    def forward(self, x):
        return x * 2


def test_activation_modules_from_outside_torch_fuse_where_their_forward_is_one_activation_call():
    model = _randomize_batchnorm(
        nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), _Swish(), nn.Conv2d(8, 8, 3), _Doubles())
    ).eval()
    network = copy.deepcopy(model)
    assert fuse_modules(network, prepack=True).fused == {'0': 'conv+bn+silu', '3': 'conv'}  # the module route
    assert isinstance(network[2], nn.Identity) and isinstance(network[4], _Doubles)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert _relative_error(network(x), model(x)) < 1e-5


class _OptionalResidual(nn.Module):
    """A forward with an argument that defaults to None and a branch on it: a trace takes the tensor's branch."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)

    def forward(self, x, extra=None):
        y = self.conv(x)
        if extra is not None:
            y = y + extra
        return y.relu()


def test_without_an_example_a_graph_that_needs_an_argument_defaulting_to_none_is_not_taken():
    model = _OptionalResidual().eval()
    fused = fuse_for_inference(model)  # nothing runs: the graph would add `extra` where a call gives none
    assert fused.summary.route == 'modules'
    assert fused.summary.trace_error == 'the traced graph computes with extra, which defaults to None'
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5
        assert _relative_error(fused(x, x), model(x, x)) < 1e-5


def test_a_hooked_submodule_stays_a_module_that_calls_its_hooks():
    model = _randomize_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 1), _ConvBnAct(8, 8), nn.Conv2d(8, 2, 1))).eval()
    seen = []
    model[1].register_forward_hook(lambda module, args, output: seen.append(output.shape) or output * 2)
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x)
    assert fused.summary.route == 'fx' and fused.summary.fused['1.conv'] == 'conv+bn+silu'  # fused inside it
    with torch.no_grad():
        expected, calls = model(x), len(seen)
        assert _relative_error(fused(x), expected) < 1e-5  # the hook's doubling included
    assert len(seen) == calls + 1 and seen[-1] == (2, 8, 8, 8)


class _Flattened(nn.Module):
    """The tutorials' LeNet flatten, ``x.view(n, -1)`` after a convolution, a BatchNorm and a pool (the fx route)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.Linear(6 * 3 * 3, 4)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        return self.fc(x.view(x.size(0), -1))


class _WrittenThroughAView(_Flattened):
    """Writes through a view of the activation, which aliases it in NCHW, then flattens it; a ``Proxy`` does not
    take the item assignment (the module route)."""

    def forward(self, x):
        z = F.relu(self.bn(self.conv(x)))
        z.view(z.size(0), -1)[:, :10] = 0
        return self.fc(F.max_pool2d(z, 2).view(z.size(0), -1))


@pytest.mark.parametrize('model_class', [_Flattened, _WrittenThroughAView])
@pytest.mark.parametrize('checked', [True, False], ids=['example', 'no-example'])
def test_code_that_views_an_activation_runs_as_in_nchw(model_class, checked, tmp_path):
    """The copy's first call is watched: the convolution whose output code views is made channels first, as
    training does (with or without an example to check on); copies, pickles and the exported program keep it."""
    torch.manual_seed(0)
    model = _randomize_batchnorm(model_class()).eval()
    x, other = torch.randn(2, 3, 8, 8), torch.randn(3, 3, 8, 8)
    fused = fuse_for_inference(model, x if checked else None)
    with torch.no_grad():
        for copied in (fused, copy.deepcopy(fused), pickle.loads(pickle.dumps(fused))):
            assert _relative_error(copied(other), model(other)) < 1e-5
    fx = model_class is _Flattened  # the module route leaves the BatchNorm, whose output is the one viewed
    assert fused.summary.route == ('fx' if fx else 'modules') and fused.summary.viewed == ['conv' if fx else 'bn']
    assert f'outputs of {fused.summary.viewed[0]} made channels first' in str(fused.summary)
    if checked:
        export_for_inference(model, tmp_path / 'viewed.pt2', x)
        program = torch.export.load(tmp_path / 'viewed.pt2').module()
        with torch.no_grad():
            assert _relative_error(program(other.to(memory_format=torch.channels_last)), model(other)) < 1e-5


class _WrittenThroughContiguousCopies(nn.Module):
    """Writes through ``.contiguous()`` of convolution outputs, the outputs themselves in NCHW: the first
    convolution's, and the second's, whose input is laid out as neither NCHW nor NHWC (H and W swapped)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Linear(4, 2)

    def forward(self, x):
        z = self.conv1(x)
        z.contiguous()[:, 0].mul_(3)
        w = self.conv2(F.relu(z).transpose(2, 3).contiguous().transpose(2, 3))
        w.contiguous()[:, 1].mul_(2)
        return self.fc(F.adaptive_avg_pool2d(w, 1).flatten(1))


def test_writes_through_what_nchw_aliases_reach_the_fused_convolutions_outputs():
    """The watch knows the fused kernels lay out their outputs as the NCHW run's convolutions would (from the
    input alone: the prepacked weights have no NCHW layout to read)."""
    torch.manual_seed(0)
    model, x = _WrittenThroughContiguousCopies().eval(), torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x)
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5
    assert fused.summary.route == 'fx' and fused.summary.viewed == ['conv1', 'conv2']


class _TwoInputs(nn.Module):
    """A network its owner calls with the images and a second tensor."""

    def __init__(self):
        super().__init__()
        self.block = _ConvBnAct(3, 4)

    def forward(self, x, scale):
        return self.block(x) * scale[:, None, None, None]


class _LabelsToo(nn.Module):
    """transformers' shape: called with a batch mapping (``net(**batch)``), first argument the images, a loss
    only when labels come, so the forward does not trace and its block does."""

    def __init__(self):
        super().__init__()
        self.block = _TwiceRelu(3)

    def forward(self, pixel_values, labels=None):
        out = self.block(pixel_values)
        return {'logits': out, 'loss': None if labels is None else (out.mean((1, 2, 3)) - labels).square().mean()}


def test_an_example_input_the_model_itself_refuses_is_named():
    with pytest.raises(ExampleInputError, match=r'_TwoInputs itself raises on example_input \(TypeError: .*scale'):
        fuse_for_inference(_TwoInputs().eval(), torch.randn(2, 3, 8, 8))


def test_fused_evaluation_checks_on_the_batch_tensor_the_network_takes_and_without_one_where_it_takes_more():
    images, scale = torch.randn(2, 3, 8, 8), torch.rand(2)
    cases = [
        (_TwoInputs(), (images, scale, torch.zeros(2)), lambda net: net(images, scale), False),
        (_LabelsToo(), {'labels': torch.zeros(2), 'pixel_values': images}, lambda net: net(images)['logits'], True),
    ]
    for network, batch, call, checked in cases:
        owner = nn.Module()
        owner.net = _randomize_batchnorm(network).eval()
        evaluation = FusedEvaluation()
        evaluation.begin_pass()
        evaluation.first_batch(lambda owner=owner: (owner, 'net', owner.net), batch)
        assert type(owner.net).__name__ == 'InferenceModel'
        assert bool(owner.net.summary.graphs) is checked  # graphs are taken only where an example checks them
        with torch.no_grad():
            assert _relative_error(call(owner.net), call(evaluation._swapped[2])) < 1e-5
        evaluation.end()
        assert owner.net is network


def test_example_input_catches_a_wrong_trace_and_takes_the_module_route():
    model = _TracesWrong().eval()
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x)
    assert fused.summary.route == 'modules' and 'differs from the model' in fused.summary.trace_error
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5


def test_example_input_catches_a_trace_that_fails_and_takes_the_module_route():
    model = _randomize_batchnorm(_TracesIntoAnError()).eval()
    x = torch.randn(2, 3, 8, 8)
    fused = fuse_for_inference(model, x)
    summary = fused.summary
    assert summary.route == 'modules' and 'the traced graph fails on the example input (RuntimeError' in (
        summary.trace_error
    )
    assert summary.fused == {'down.0': 'conv+bn+relu', 'up.0': 'conv+bn+relu'}
    with torch.no_grad():
        assert _relative_error(fused(x), model(x)) < 1e-5


class _BranchesOnWidth(nn.Module):
    """Control flow on its input's width: fx cannot trace it, so it is kept whole."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x)) if x.shape[-1] > 4 else x


class _CallsForward(nn.Module):
    """A blur, then its convolution called through ``.forward``, as Composer's ``BlurConv2d`` does."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv.forward(nn.functional.avg_pool2d(x, 3, 1, 1))


class _UntraceableBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.block, self.down, self.down_bn = _BranchesOnWidth(), _CallsForward(), nn.BatchNorm2d(8)
        self.strided, self.strided_bn, self.post = nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        x = self.down_bn(self.down(self.block(self.stem(x))))
        x = nn.functional.conv2d(x, self.strided.weight, self.strided.bias, stride=2)  # not what self.strided does
        return self.post(torch.relu(self.strided_bn(x)))


def test_an_untraceable_block_is_kept_whole_and_the_batchnorms_left_unfused_are_named():
    model = _randomize_batchnorm(_UntraceableBlock()).eval()
    x = torch.randn(2, 3, 8, 8)
    message = 'fuse_for_inference: 2 BatchNorms left unfused: block.bn, post; they run as separate ops'
    with pytest.warns(UserWarning, match=re.escape(message)):
        fused = fuse_for_inference(model, x)
    summary = fused.summary
    assert summary.route == 'fx' and summary.trace_error is None
    # the block's forward does not trace, alone either: its conv is fused by itself; the functional call
    # on strided's weight with other settings is a convolution of its own
    assert summary.fused == {
        'stem.0': 'conv+bn+relu',
        'down.conv': 'conv+bn',
        'strided.conv2d': 'conv+bn+relu',
        'block.conv': 'conv',
    }
    assert summary.unfused == ['block.bn', 'post']
    assert str(summary).startswith('fx: 4 convolutions fused, 3 of 5 BatchNorms folded, 2 with an activation')
    with torch.no_grad():
        for size in (8, 4):  # the block runs its own code: at 4 px it returns its input
            images = torch.randn(3, 3, size, size)
            assert _relative_error(fused(images), model(images)) < 1e-5


def _no_unfused_warning(fuse, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        result = fuse(*args)
    assert not [str(w.message) for w in caught if 'left unfused' in str(w.message)]
    return result


def test_blurpool_resnet18_folds_every_batchnorm_and_exports(tmp_path):
    """Composer's BlurPool: its blur, which sizes its filter from the input's channels, runs whole as a
    function; the convolution BlurConv2d calls through ``.conv.forward`` fuses with the BatchNorm and ReLU
    after it."""
    pytest.importorskip('composer')
    from composer.algorithms.blurpool import apply_blurpool
    from composer.algorithms.blurpool.blurpool_layers import blur_2d

    torch.manual_seed(0)
    model = build_model('resnet18', num_classes=10)
    apply_blurpool(model)
    model = _randomize_batchnorm(model).eval()
    x, other = torch.randn(2, 3, 32, 32), torch.randn(3, 3, 48, 48)
    fused = _no_unfused_warning(fuse_for_inference, model, x)
    summary = fused.summary
    assert summary.route == 'fx' and summary.trace_error is None and summary.unfused == []
    assert summary.count('bn') == 20 and '20 of 20 BatchNorms folded' in str(summary)
    assert summary.fused['layer2.0.conv1.conv'] == 'conv+bn+relu'  # BlurConv2d's convolution
    assert blur_2d in {node.target for node in fused.module.graph.nodes}  # called whole
    with torch.no_grad():
        assert _relative_error(fused(other), model(other)) < 1e-5
        model64, x64 = copy.deepcopy(model).double(), other.double()
        torch.testing.assert_close(fuse_for_inference(model64, x64)(x64), model64(x64), rtol=1e-12, atol=1e-12)

    _, exported = _no_unfused_warning(export_for_inference, model, tmp_path / 'blurpool.pt2', x)
    assert exported.count('bn') == 20
    program = torch.export.load(tmp_path / 'blurpool.pt2').module()
    images = torch.randn(3, 3, 32, 32)  # the example's height and width, another batch size
    with torch.no_grad():
        assert _relative_error(program(images.to(memory_format=torch.channels_last)), model(images)) < 1e-5


class _ResidualReadAfterwards(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        residual = self.first(x)
        out = torch.relu(self.second(residual) + residual)  # residual is the conv's own input
        return torch.relu(self.third(out) + residual), residual  # and is read after this add


def test_residual_add_is_in_place_only_when_nothing_reads_the_residual_later():
    model = _ResidualReadAfterwards().eval()
    fused = fuse_for_inference(model)
    adds = {path: kernel for path, kernel in fused.summary.fused.items() if 'add' in kernel}
    assert adds == {'second': 'conv+add+relu', 'third': 'conv+add+relu'}
    assert not any(m.add_in_place for m in fused.modules() if isinstance(m, FusedConv2d))
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        for actual, expected in zip(fused(x), model(x)):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason='oneDNN has no bfloat16 on this CPU')
def test_bfloat16_under_autocast_and_as_a_bfloat16_copy():
    torch.manual_seed(0)
    model = _randomize_batchnorm(build_model('resnet18', num_classes=10)).eval()
    fused = fuse_for_inference(model)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            autocast = fused(x)
        bf16_copy = fused.to(torch.bfloat16)(x.bfloat16())
    assert autocast.dtype == bf16_copy.dtype == torch.bfloat16
    assert _relative_error(autocast, expected) < 3e-2
    assert _relative_error(bf16_copy, expected) < 3e-2


def test_export_command_saves_a_program_that_runs_without_this_package(tmp_path):
    torch.manual_seed(0)
    model = _randomize_batchnorm(build_model('resnet18', num_classes=10)).eval()
    torch.save(model.state_dict(), tmp_path / 'weights.pt')
    out = tmp_path / 'resnet18.pt2'
    assert (
        main(
            [
                'export',
                'resnet18',
                str(out),
                '--input',
                '2,3,16,16',
                '--num-classes',
                '10',
                '--weights',
                str(tmp_path / 'weights.pt'),
            ]
        )
        == 0
    )
    x = torch.randn(3, 3, 16, 16)  # another batch size: the batch dimension is dynamic
    torch.save(x, tmp_path / 'x.pt')
    script = (
        "import sys; sys.modules['channels_last_algo'] = None; import torch; "
        f'program = torch.export.load({str(out)!r}).module(); x = torch.load({str(tmp_path / "x.pt")!r}); '
        f'torch.save(program(x.to(memory_format=torch.channels_last)), {str(tmp_path / "y.pt")!r})'
    )
    subprocess.run([sys.executable, '-c', script], check=True, cwd=tmp_path)
    with torch.no_grad():
        assert _relative_error(torch.load(tmp_path / 'y.pt'), model(x)) < 1e-4


def _trainer(fuse_eval, loader, save_folder):
    from composer import Trainer
    from composer.algorithms import EMA
    from composer.models import ComposerClassifier

    from channels_last_algo import ChannelsLast

    torch.manual_seed(0)
    model = ComposerClassifier(_randomize_batchnorm(TinyResNet(width=16)), num_classes=10)
    return Trainer(
        model=model,
        train_dataloader=loader,
        eval_dataloader=loader,
        max_duration='3ba',
        eval_interval='1ba',
        device='cpu',
        progress_bar=False,
        seed=0,
        save_folder=save_folder,
        save_interval='1ba',
        save_overwrite=True,
        algorithms=[ChannelsLast(fuse_eval=fuse_eval), EMA(half_life='1ba', update_interval='1ba')],
    )


def test_composer_evaluation_with_fuse_eval_gives_the_same_metrics(tmp_path):
    pytest.importorskip('composer', reason='the Composer integration needs Composer')
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(
            torch.randn(24, 3, 16, 16, generator=generator), torch.randint(0, 10, (24,), generator=generator)
        ),
        batch_size=8,
    )
    results = {}
    for fuse_eval in (False, True):
        trainer = _trainer(fuse_eval, loader, save_folder=str(tmp_path / f'fuse_eval_{fuse_eval}'))
        network = trainer.state.model.module
        calls = []
        network.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(module.training))
        trainer.fit()
        metrics = {name: metric.compute().item() for name, metric in trainer.state.eval_metrics['eval'].items()}
        predictions = torch.cat(trainer.predict(loader))
        assert trainer.state.model.module is network  # the training network is back after each pass
        # 3 evaluation passes of 3 batches and a prediction pass of 3; with fuse_eval, the training
        # network runs in eval mode once per pass: the check of the fused copy on the first batch
        assert calls.count(False) == (3 + 1 if fuse_eval else 3 * 3 + 3)
        results[fuse_eval] = metrics, predictions, network.state_dict().keys()
    (metrics, predictions, _), (fused_metrics, fused_predictions, keys) = results[False], results[True]
    assert metrics.keys() == fused_metrics.keys()
    for name in metrics:
        assert fused_metrics[name] == pytest.approx(metrics[name], rel=1e-4), name
    torch.testing.assert_close(fused_predictions, predictions, rtol=1e-4, atol=1e-4)
    checkpoint = torch.load(tmp_path / 'fuse_eval_True' / 'latest-rank0.pt', weights_only=False)
    assert checkpoint['state']['model'].keys() == {f'module.{key}' for key in keys}  # the training network


@pytest.mark.slow
@pytest.mark.parametrize('name', ['resnet50', 'efficientnet_b0'])
def test_repaired_models_still_fuse_on_the_fx_route(name):
    """apply_channels_last repairs by default; the repaired layers branch on their input's shape,
    so they must stay fx leaves or the whole model would fall back to the weaker module route."""
    torch.manual_seed(0)
    model = build_model(name)
    assert apply_channels_last(model).repaired
    model.eval()
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    fused = fuse_for_inference(model, x)
    assert fused.summary.trace_error is None and str(fused.summary).startswith('fx:')
    assert str(fused.summary).count('0 with a residual add') == 0
