"""Repair: every rule removes the break it names where its row says the break exists (a probe
on the installed torch), the torchvision zoo and the UNet train with zero layout breaks after
conversion + repair, and repaired models keep their state, their numbers, and their use with
fx, TorchScript, torch.export and ONNX export."""

import copy
import pickle

import pytest
import torch
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.shufflenetv2 import InvertedResidual

from channels_last_algo.core.audit import audit_model
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import (
    RULES,
    ChannelsLastAdaptiveAvgPool2d,
    ChannelsLastInstanceNorm2d,
    RepairRule,
    repair_model,
    unrepaired_subclasses,
)
from channels_last_algo.core.layout import is_channels_last, to_channels_last
from channels_last_algo.core.runtime import version_in
from channels_last_algo.core.swap import Replacement, SwapRecord, UncoveredLayer
from conftest import zoo

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


# the zoo and the UNet: zero breaks, same state, same numbers


def _build(name):
    entry = zoo.by_name(name)
    return zoo.build(entry), entry.input_shape


@pytest.fixture(scope='module', params=[entry.name for entry in zoo.TORCHVISION_ZOO])
def case(request):
    """(name, NCHW model, its input shape, repaired channels-last copy, repair records)."""
    reference, shape = _build(request.param)
    model, records = _repaired(copy.deepcopy(reference))
    return request.param, reference, shape, model, records


def test_no_layout_break_forward_or_backward(case):
    name, _, shape, model, _ = case
    model.train()
    report = audit_model(model, _nhwc(*shape), backward=True)
    assert report.breaks == [], f'{name} after repair:\n{report}'


def test_state_dict_keys_and_values_stay_the_same(case):
    _, reference, _, model, _ = case
    expected, actual = reference.state_dict(), model.state_dict()
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key
    model.load_state_dict(expected)  # checkpoints load both ways (the values are equal: nothing changes)
    reference.load_state_dict(actual)
    assert all(is_channels_last(p) for p in model.parameters() if p.dim() == 4)


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


# every rule: a probe of its break on the installed torch, and the break gone after repair


def _tiny_mobilenet_v2():
    return MobileNetV2(num_classes=4, width_mult=0.25, inverted_residual_setting=[[1, 16, 1, 1], [6, 24, 1, 2]])


BREAKING_MODELS = {
    'global_avg_pool': (
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.SiLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2)),
        ('aten.silu_backward.default', '1', 'backward'),
    ),
    'mobilenet_v2_global_pool': (
        _tiny_mobilenet_v2,
        ('aten.hardtanh_backward.default', 'features.3.2', 'backward'),
    ),
    'shufflenet_channel_shuffle': (
        lambda: nn.Sequential(
            nn.Conv2d(3, 24, 3), InvertedResidual(24, 48, 2), InvertedResidual(48, 48, 1), nn.Conv2d(48, 8, 1)
        ),
        ('aten.cat.default', '2', 'forward'),
    ),
    'instance_norm': (
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, affine=True), nn.ReLU(), nn.Conv2d(8, 4, 3)),
        ('aten.clone.default', '1', 'forward'),
    ),
    'bicubic_upsample': (
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.Upsample(scale_factor=2, mode='bicubic'), nn.Conv2d(8, 4, 3)),
        ('aten.upsample_bicubic2d_backward.default', '1', 'backward'),
    ),
}


def _timm(module, name):
    """A layer class of another library (the test skips without it)."""
    return getattr(pytest.importorskip(module), name)


def _ghost_block(mode):
    block = _timm('timm.models.ghostnet', 'GhostBottleneck')
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), block(8, 16, 8, mode=mode), nn.Conv2d(8, 4, 1))


def _std_conv(layer):
    return lambda: nn.Sequential(_timm('timm.layers.std_conv', layer)(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1))


BREAKING_MODELS |= {
    # torch 2.14's slice_backward keeps NHWC, 2.7's does not; the add of the two gradients breaks on both
    'channel_slice': (lambda: _ghost_block('original'), ('aten.add.Tensor', '1.ghost1.primary_conv.0', 'backward')),
    'channel_slice_gated': (lambda: _ghost_block('attn'), ('aten.add.Tensor', '1.ghost1.primary_conv.0', 'backward')),
    'pooled_upsample': (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), _timm('torchvision.models.segmentation.deeplabv3', 'ASPP')(8, [2], 8)
        ),
        ('aten.cat.default', '1', 'forward'),
    ),
    'split_attention': (
        lambda: nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            _timm('timm.layers.split_attn', 'SplitAttn')(8, 8, radix=2),
            nn.AvgPool2d(3, 2, 1),
            nn.Conv2d(8, 4, 1),
        ),
        ('aten.avg_pool2d_backward.default', '2', 'backward'),
    ),
    **{
        f'weight_standardization_{i}': (_std_conv(layer), ('aten.clone.default', '0', 'backward'))
        for i, layer in enumerate(('StdConv2d', 'StdConv2dSame', 'ScaledStdConv2d', 'ScaledStdConv2dSame'))
    },
}


def test_every_rule_that_applies_on_cpu_has_a_probe():
    assert set(BREAKING_MODELS) == {r.name for r in RULES if 'cpu' in r.devices}


@pytest.mark.parametrize('rule', sorted(BREAKING_MODELS))
def test_rule_removes_the_break_it_names_where_its_row_says_it_exists(rule):
    """The probe: without the rule, the break is there exactly when the row says so for this torch."""
    row = next(r for r in RULES if r.name == rule)
    build, (op, path, phase) = BREAKING_MODELS[rule]
    torch.manual_seed(0)
    model = build()
    apply_channels_last(model, repair=False)
    x = _nhwc(2, 3, 16, 16)
    before = audit_model(model, x)
    found = (op, path, phase) in {(b.op, b.module_path, b.phase) for b in before.breaks}
    where = f'{rule} ({row.torch_versions}) on torch {torch.__version__}'
    assert found == row.applies(torch.device('cpu')), f'{where}:\n{before}'
    records = repair_model(model)
    assert (rule in {r.reason for r in records}) == found
    after = audit_model(model, x)
    assert after.breaks == [], str(after)


class SameIdentity(Replacement, nn.Identity):
    """A replacement that computes what ``nn.Identity`` does."""


def test_rules_apply_only_to_the_torch_versions_and_devices_in_their_row():
    row = RepairRule(
        name='old',
        breaks='x (forward)',
        original=nn.Identity,
        replacement=SameIdentity,
        removes='x',
        devices=('cuda',),
        torch_versions='>=2.7,<2.10',
    )
    assert row.applies(torch.device('cuda'), '2.9.1+cu128') and not row.applies(torch.device('cuda'), '2.10.0')
    assert not row.applies(torch.device('cpu'), '2.9.1')
    assert not row.matches(nn.Identity(), torch.device('cpu'))
    assert version_in('2.14.1', '>=2.7') and not version_in('2.6', '>=2.7') and version_in('2.7', '==2.7.0')
    with pytest.raises(ValueError, match="clause '~2.7' must start with"):
        version_in('2.7.0', '~2.7')


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
    model, records = _repaired(copy.deepcopy(reference), device='cuda')
    assert {r.reason for r in records} == CUDA_RULES | {'instance_norm', 'bicubic_upsample'}
    x = torch.randn(*shape)
    report = audit_model(model, to_channels_last(x))
    assert report.breaks == [], str(report)
    _assert_same_numbers(_step(model, to_channels_last(x)), _step(reference, x), rtol=1e-4, atol_scale=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')
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


# the rule table and repair_model


def test_rules_skip_modules_whose_settings_they_do_not_cover():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.InstanceNorm2d(4, track_running_stats=True),
        nn.Upsample(scale_factor=2, mode='bilinear'),
        nn.AdaptiveAvgPool2d(2),
    )
    assert repair_model(model) == []


def test_subclasses_of_a_rule_type_with_their_own_forward_are_left_alone_and_named():
    class MyPool(nn.AdaptiveAvgPool2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Conv2d(3, 4, 3), MyPool(1))
    assert repair_model(model) == []
    assert unrepaired_subclasses(model) == [
        UncoveredLayer('1', 'repair', 'global_avg_pool', f'{__name__}.{MyPool.__qualname__}', ('forward',))
    ]
    assert apply_channels_last(model).not_covered == unrepaired_subclasses(model)


def test_subclasses_of_a_rule_type_that_keep_its_forward_are_repaired_and_keep_their_class():
    class NamedPool(nn.AdaptiveAvgPool2d):
        def extra_repr(self) -> str:
            return 'named'

    model = nn.Sequential(nn.Conv2d(3, 4, 3), NamedPool(1))
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    expected = model.double()(x)
    [record] = repair_model(model)
    assert (record.reason, record.original, record.replacement) == (
        'global_avg_pool',
        f'{__name__}.{NamedPool.__qualname__}',
        'ChannelsLastAdaptiveAvgPool2d',
    )
    assert isinstance(model[1], NamedPool) and isinstance(model[1], ChannelsLastAdaptiveAvgPool2d)
    assert repr(model[1]).endswith('(named)') and unrepaired_subclasses(model) == []
    torch.testing.assert_close(model(to_channels_last(x)), expected)
    assert repair_model(model) == []


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
    restored = pickle.loads(pickle.dumps(model))  # loads without this package (tests/test_pickle_without_package.py)
    assert type(restored.down1[1]) is nn.InstanceNorm2d


def test_a_replacement_must_subclass_the_original_and_the_replacement_base():
    with pytest.raises(TypeError, match="repair rule 'bad'.*must subclass torch.nn.modules.conv.Conv2d"):
        RepairRule(name='bad', breaks='none', original=nn.Conv2d, replacement=nn.Identity, removes='nothing')

    class PlainConv(nn.Conv2d):
        pass

    with pytest.raises(TypeError, match="'bad'.*must subclass channels_last_algo.core.swap.Replacement, then"):
        RepairRule(name='bad', breaks='none', original=nn.Conv2d, replacement=PlainConv, removes='nothing')
