"""Repair on whole models: the torchvision zoo and the UNet of the benchmarks (``benchmarks/zoo_models.py``)
train with zero layout breaks after conversion + repair, keep their state and their numbers, the CUDA-only
rules apply to the UNet only on CUDA, and repaired models stay usable with fx, TorchScript, torch.export
and ONNX export. Every rule's probe and the rule table: core/test_repair.py; the layers: core/test_repair_layers.py."""

import copy
import gc
import io
import pickle

import pytest
import torch
from torch import nn

from benchmarks import zoo_models as zoo
from channels_last_algo.app.recipes.models import build_model
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import RULES, ChannelsLastInstanceNorm2d, repair_model
from channels_last_algo.core.layout import is_channels_last, to_channels_last
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.swap_records import SwapRecord

UNet = zoo.UNet


def _nhwc(*shape, dtype=torch.float32):
    return to_channels_last(torch.randn(*shape, dtype=dtype))


def _outputs(result):
    return list(result) if isinstance(result, tuple) else [result]


def _step(model, x):
    """Outputs and parameter gradients of one forward and backward with a fixed random loss."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    outputs = _outputs(model(x))
    torch.manual_seed(1)
    loss = sum((y * torch.randn(y.shape).to(y.device)).sum() for y in outputs)  # the same numbers on any device
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return [y.detach() for y in outputs], grads


def _assert_same_numbers(actual, expected, rtol, atol_scale):
    """Outputs and gradients equal within ``rtol`` and an absolute tolerance of ``atol_scale``
    times the largest value of their kind (gradients of biases just before a norm are 0 up to
    rounding, so a relative tolerance alone cannot compare them)."""
    (out_a, grads_a), (out_e, grads_e) = actual, expected
    for a, e in zip(out_a, out_e, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol_scale * e.abs().max().item())
    assert grads_a.keys() == grads_e.keys()
    scale = max(g.abs().max().item() for g in grads_e.values())
    for name in grads_e:
        torch.testing.assert_close(grads_a[name], grads_e[name], rtol=rtol, atol=atol_scale * scale, msg=name)


def _set_mode(model, types, training):
    for module in model.modules():
        if isinstance(module, types):
            module.train(training)


def _repaired(model, device=None):
    if device is None:  # the way users get it: apply_channels_last repairs by default
        return model, apply_channels_last(model).repaired
    apply_channels_last(model, repair=False)
    return model, repair_model(model, device=device)


# the zoo and the UNet: zero breaks, same state, same numbers (a sweep of the torchvision zoo: slow)


def _build(name):
    entry = zoo.by_name(name)
    return zoo.build(entry), entry.input_shape


@pytest.fixture(scope='module', params=[entry.name for entry in zoo.TORCHVISION_ZOO])
def case(request):
    """(name, NCHW model, its input shape, repaired channels-last copy, repair records)."""
    reference, shape = _build(request.param)
    model, records = _repaired(copy.deepcopy(reference))
    return request.param, reference, shape, model, records


@pytest.mark.slow
def test_no_layout_break_forward_or_backward(case):
    name, _, shape, model, _ = case
    model.train()
    report = audit_model(model, _nhwc(*shape), backward=True)
    assert report.breaks == [], f'{name} after repair:\n{report}'


@pytest.mark.slow
def test_state_dict_keys_and_values_stay_the_same(case):
    _, reference, _, model, _ = case
    expected, actual = reference.state_dict(), model.state_dict()
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    model.load_state_dict(expected)  # checkpoints load both ways (the values are equal: nothing changes)
    reference.load_state_dict(actual)
    assert all(is_channels_last(p) for p in model.parameters() if p.dim() == 4)


@pytest.mark.slow
def test_matches_the_nchw_model(case):
    """Outputs and gradients against the unrepaired NCHW model. BatchNorm is in eval mode here:
    with batch statistics of 2 images at 2x2, BatchNorm's backward magnifies the rounding
    differences of NHWC convolutions themselves (1e-2 relative, with or without repair);
    the next test covers training mode. Tolerances allow for ReLU and max-pool ties that
    NHWC rounding flips (wide_resnet50_2, vgg11_bn)."""
    name, reference, shape, model, _ = case
    x = torch.randn(*shape)
    norm_and_dropout = (nn.modules.batchnorm._BatchNorm, nn.Dropout)
    for m in (reference, model):
        _set_mode(m, norm_and_dropout, training=False)
    try:
        expected, actual = _step(reference, x), _step(model, to_channels_last(x))
    finally:
        for m in (reference, model):
            m.train()
    outputs_a, grads_a = actual
    outputs_e, grads_e = expected
    for a, e in zip(outputs_a, outputs_e, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5 * e.abs().max().item())
    assert grads_a.keys() == grads_e.keys()
    scale = max(g.abs().max().item() for g in grads_e.values())
    for key, e in grads_e.items():
        error = (grads_a[key] - e).norm().item()
        assert error <= 1e-2 * e.norm().item() + 1e-5 * scale * e.numel() ** 0.5, f'{name} {key}: {error}'


@pytest.mark.slow
def test_matches_plain_channels_last_in_training(case):
    """In training mode (BatchNorm batch statistics), repair changes no number that plain
    channels last computes."""
    _, reference, shape, model, _ = case
    plain = copy.deepcopy(reference)
    apply_channels_last(plain, repair=False)
    model = copy.deepcopy(model)  # training mode updates BatchNorm's running statistics
    for m in (plain, model):
        _set_mode(m, nn.Dropout, training=False)
    x = _nhwc(*shape)
    _assert_same_numbers(_step(model, x), _step(plain, x), rtol=1e-4, atol_scale=1e-5)


@pytest.mark.slow
def test_records_name_the_swapped_modules(case):
    name, reference, _, model, records = case
    for record in records:
        rule = next(r for r in RULES if r.name == record.reason)
        assert type(model.get_submodule(record.path)) is rule.replacement
        assert type(reference.get_submodule(record.path)) is rule.original
    expected = {
        'resnet50': {'global_avg_pool'},
        'densenet121': set(),
        'efficientnet_b0': {'global_avg_pool'},
        'mobilenet_v2': {'mobilenet_v2_global_pool'},
        'shufflenet_v2_x1_0': {'shufflenet_channel_shuffle'},
        'vgg11_bn': set(),
        'mnasnet1_0': set(),
        'unet': {'instance_norm', 'bicubic_upsample'},
    }
    if name in expected:
        assert {r.reason for r in records} == expected[name]
    assert repair_model(model) == []  # idempotent


# CUDA-only rules: applied only on CUDA, and the same numbers as the native layers on CPU

CUDA_RULES = {r.name for r in RULES if r.devices == ('cuda',)}


def test_cuda_only_rules_apply_only_to_models_on_cuda():
    model = UNet()
    assert not CUDA_RULES & {r.reason for r in repair_model(copy.deepcopy(model))}
    assert not CUDA_RULES & {r.reason for r in repair_model(copy.deepcopy(model), device='cpu')}
    applied = {r.reason for r in repair_model(copy.deepcopy(model), device=torch.device('cuda'))}
    assert applied == CUDA_RULES | {'instance_norm', 'bicubic_upsample'}


def test_unet_with_cuda_rules_matches_and_keeps_nhwc_on_cpu():
    reference, shape = _build('unet')
    reference = reference.double()  # float32 sums differ by CPU more than a tight tolerance allows
    model, records = _repaired(copy.deepcopy(reference), device='cuda')
    assert {r.reason for r in records} == CUDA_RULES | {'instance_norm', 'bicubic_upsample'}
    x = torch.randn(*shape, dtype=torch.float64)
    report = audit_model(model, to_channels_last(x))
    assert report.breaks == [], str(report)
    _assert_same_numbers(_step(model, to_channels_last(x)), _step(reference, x), rtol=1e-9, atol_scale=1e-10)


@pytest.mark.cuda
def test_unet_on_cuda_breaks_where_the_cuda_rules_say_and_not_after_repair():
    reference, shape = _build('unet')
    x = _nhwc(*shape).cuda()
    cpu_rules_only, _ = _repaired(copy.deepcopy(reference).cuda(), device='cpu')
    before = audit_model(cpu_rules_only, x)
    broken = {type(cpu_rules_only.get_submodule(b.module_path)) for b in before.breaks if b.module_path}
    assert {r.original for r in RULES if r.devices == ('cuda',)} <= broken, str(before)
    model, records = _repaired(copy.deepcopy(reference).cuda())
    assert CUDA_RULES <= {r.reason for r in records}
    after = audit_model(model, x)
    assert after.breaks == [], str(after)
    x = torch.randn(*shape, device='cuda')
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        _assert_same_numbers(_step(model, to_channels_last(x)), _step(reference.cuda(), x), rtol=1e-3, atol_scale=1e-4)


def test_repair_keeps_parameter_objects_and_hooks_copies_keep_it_and_pickles_hold_the_original():
    model = UNet()
    params = list(model.parameters())
    calls = []
    hook = model.down1[1].register_forward_hook(lambda *args: calls.append(1))
    records = repair_model(model)
    assert [r for r in records if r.path == 'down1.1'] == [
        SwapRecord(
            'down1.1',
            'repair',
            'instance_norm',
            'torch.nn.modules.instancenorm.InstanceNorm2d',
            'ChannelsLastInstanceNorm2d',
        )
    ]
    assert all(p is q for p, q in zip(params, model.parameters()))
    model(torch.randn(1, 3, 16, 16))
    assert calls == [1]
    hook.remove()  # a lambda does not pickle
    assert type(copy.deepcopy(model).down1[1]) is ChannelsLastInstanceNorm2d
    restored = pickle.loads(pickle.dumps(model))  # loads without this package (core/test_pickle_without_package.py)
    assert type(restored.down1[1]) is nn.InstanceNorm2d


# repaired models stay usable with fx, TorchScript, torch.export and ONNX export (the sweep of TRACED: slow)

TRACED = ['resnet18', 'efficientnet_b0', 'convnext_tiny', 'mobilenet_v3_small', 'shufflenet_v2_x0_5', 'unet']


def _traced_case(name):
    """(NCHW float64 model in eval mode, repaired channels-last copy, NHWC input); the UNet repaired
    with the CUDA rules too, so that every repaired layer is traced."""
    torch.manual_seed(0)
    if name == 'unet':
        reference, shape = UNet().double(), (2, 3, 16, 16)
    else:
        reference, shape = build_model(name, num_classes=10).double(), (2, 3, 32, 32)
    reference.eval()
    model = copy.deepcopy(reference)
    apply_channels_last(model, repair=False)
    assert repair_model(model, device='cuda' if name == 'unet' else 'cpu')
    return reference, model, to_channels_last(torch.randn(*shape, dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize('name', TRACED)
def test_repaired_model_traces_scripts_and_exports_with_the_same_outputs(name):
    # compiled models of earlier tests, once collected, take the idle module-call hooks off, which
    # torch 2.7's strict torch.export refuses (docs/audit.md)
    gc.collect()
    reference, model, x = _traced_case(name)
    with torch.no_grad():
        expected = reference(x.contiguous())
        torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(torch.jit.script(model)(x), expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(torch.export.export(model, (x,)).module()(x), expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('name', ['resnet18', 'unet'])
def test_repaired_model_exports_to_onnx(name):
    """The TorchScript-based exporter (``dynamo=False``) writes a valid graph; core/test_export_matrix.py
    runs both exporters' files in onnxruntime."""
    onnx = pytest.importorskip('onnx')
    _, model, x = _traced_case(name)
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, dynamo=False)
    graph = onnx.load_from_string(buffer.getvalue())
    onnx.checker.check_model(graph)
    assert len(graph.graph.node) > 10
