"""Repair: every rule removes the break it names, the zoo and the UNet train with zero layout
breaks after conversion + repair, and repaired models keep their state and their numbers."""

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.shufflenetv2 import InvertedResidual, channel_shuffle

from channels_last_algo.core.audit import audit_model
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import (
    RULES,
    ChannelsLastBicubicUpsample,
    ChannelsLastGroupNorm,
    ChannelsLastInstanceNorm2d,
    ChannelsLastPixelShuffle,
    ChannelsLastPixelUnshuffle,
    ChannelsLastReflectionPad2d,
    ChannelsLastReplicationPad2d,
    RepairRecord,
    RepairRule,
    bicubic_upsample_nhwc,
    global_avg_pool_nhwc,
    interleave_channels,
    pad_nhwc,
    pixel_shuffle_nhwc,
    pixel_unshuffle_nhwc,
    repair_model,
)
from channels_last_algo.core.layers import bicubic as bicubic_module
from channels_last_algo.core.layout import is_channels_last, to_channels_last
from unet import UNet

ZOO = [
    'resnet50', 'resnext50_32x4d', 'wide_resnet50_2', 'densenet121', 'efficientnet_b0', 'mobilenet_v2',
    'mobilenet_v3_large', 'shufflenet_v2_x1_0', 'squeezenet1_1', 'googlenet', 'vgg11_bn', 'mnasnet1_0',
    'regnet_y_400mf', 'convnext_tiny',
]
ZOO_INPUT = (2, 3, 64, 64)  # GoogLeNet needs >= 64 px; the last stage is 2x2, not ambiguous
UNET_INPUT = (2, 3, 32, 32)


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
    loss = sum((y * torch.randn(y.shape)).sum() for y in outputs)
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
    torch.manual_seed(0)
    if name == 'unet':
        return UNet(), UNET_INPUT
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)  # googlenet's init_weights notice
        return getattr(torchvision.models, name)(weights=None), ZOO_INPUT


@pytest.fixture(scope='module', params=ZOO + ['unet'])
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
        rule = next(r for r in RULES if r.name == record.rule)
        assert type(model.get_submodule(record.path)) is rule.replacement
        assert type(reference.get_submodule(record.path)) is rule.original
    expected = {
        'resnet50': {'global_avg_pool'}, 'densenet121': set(), 'efficientnet_b0': {'global_avg_pool'},
        'mobilenet_v2': {'mobilenet_v2_global_pool'}, 'shufflenet_v2_x1_0': {'shufflenet_channel_shuffle'},
        'vgg11_bn': set(), 'mnasnet1_0': set(), 'unet': {'instance_norm', 'bicubic_upsample'},
    }
    if name in expected:
        assert {r.rule for r in records} == expected[name]
    assert repair_model(model) == []  # idempotent


# every CPU rule removes a break that the audit finds without it


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
        lambda: nn.Sequential(nn.Conv2d(3, 24, 3), InvertedResidual(24, 48, 2), InvertedResidual(48, 48, 1),
                              nn.Conv2d(48, 8, 1)),
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


def test_every_rule_that_applies_on_cpu_has_a_breaking_model():
    assert set(BREAKING_MODELS) == {r.name for r in RULES if not r.cuda_only}


@pytest.mark.parametrize('rule', sorted(BREAKING_MODELS))
def test_rule_removes_the_break_it_names(rule):
    build, (op, path, phase) = BREAKING_MODELS[rule]
    torch.manual_seed(0)
    model = build()
    apply_channels_last(model, repair=False)
    x = _nhwc(2, 3, 16, 16)
    before = audit_model(model, x)
    assert (op, path, phase) in {(b.op, b.module_path, b.phase) for b in before.breaks}, str(before)
    records = repair_model(model)
    assert rule in {r.rule for r in records}
    after = audit_model(model, x)
    assert after.breaks == [], str(after)


# CUDA-only rules: applied only on CUDA, and the same numbers as the native layers on CPU

CUDA_RULES = {r.name for r in RULES if r.cuda_only}


def test_cuda_only_rules_apply_only_to_models_on_cuda():
    model = UNet()
    assert not CUDA_RULES & {r.rule for r in repair_model(copy.deepcopy(model))}
    assert not CUDA_RULES & {r.rule for r in repair_model(copy.deepcopy(model), device='cpu')}
    applied = {r.rule for r in repair_model(copy.deepcopy(model), device=torch.device('cuda'))}
    assert applied == CUDA_RULES | {'instance_norm', 'bicubic_upsample'}


def test_unet_with_cuda_rules_matches_and_keeps_nhwc_on_cpu():
    reference, shape = _build('unet')
    model, records = _repaired(copy.deepcopy(reference), device='cuda')
    assert {r.rule for r in records} == CUDA_RULES | {'instance_norm', 'bicubic_upsample'}
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
    assert {r.original for r in RULES if r.cuda_only} <= broken, str(before)
    model, records = _repaired(copy.deepcopy(reference).cuda())
    assert CUDA_RULES <= {r.rule for r in records}
    after = audit_model(model, x)
    assert after.breaks == [], str(after)
    x = torch.randn(*shape, device='cuda')
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        _assert_same_numbers(_step(model, to_channels_last(x)), _step(reference.cuda(), x), rtol=1e-3,
                             atol_scale=1e-4)


# each replacement layer against the layer it replaces


def _compare_layers(original, replacement_type, x, rtol=1e-5, atol=1e-5):
    """Same output and input gradient as ``original`` (NCHW), with NHWC output and gradient."""
    swapped = copy.deepcopy(original)
    swapped.__class__ = replacement_type
    x_ref = x.detach().contiguous().requires_grad_()
    x_cl = to_channels_last(x.detach()).requires_grad_()
    expected, actual = original(x_ref), swapped(x_cl)
    assert is_channels_last(actual)
    torch.manual_seed(2)
    grad = to_channels_last(torch.randn(expected.shape, dtype=x.dtype))
    expected.backward(grad.contiguous())
    actual.backward(grad)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    torch.testing.assert_close(x_cl.grad, x_ref.grad, rtol=rtol, atol=atol)
    for (name, p), q in zip(swapped.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize('padding', [1, (2, 1, 0, 3), (3, 3, 1, 1), (-1, 2, 1, -2)])
@pytest.mark.parametrize('original,replacement', [
    (nn.ReflectionPad2d, ChannelsLastReflectionPad2d),
    (nn.ReplicationPad2d, ChannelsLastReplicationPad2d),
])
def test_padding_matches(original, replacement, padding):
    _compare_layers(original(padding), replacement, torch.randn(2, 5, 6, 7), rtol=0, atol=1e-6)


def test_reflection_padding_as_large_as_the_input_is_refused():
    with pytest.raises(ValueError, match=r'reflection padding \(4, 0\) must be smaller than the padded dimension'):
        pad_nhwc(torch.randn(1, 2, 4, 4), (0, 0, 4, 0), 'reflect')
    with pytest.raises(ValueError, match="mode 'reflect' or 'replicate', not 'circular'"):
        pad_nhwc(torch.randn(1, 2, 4, 4), (1, 1, 1, 1), 'circular')


@pytest.mark.parametrize('factor', [2, 3])
def test_pixel_shuffle_and_unshuffle_match(factor):
    shuffle_input = torch.randn(2, 4 * factor**2, 3, 5)
    unshuffle_input = torch.randn(2, 4, 3 * factor, 2 * factor)
    _compare_layers(nn.PixelShuffle(factor), ChannelsLastPixelShuffle, shuffle_input, rtol=0, atol=0)
    _compare_layers(nn.PixelUnshuffle(factor), ChannelsLastPixelUnshuffle, unshuffle_input, rtol=0, atol=0)


def test_pixel_shuffle_refuses_what_the_native_op_refuses():
    with pytest.raises(ValueError, match='channels divisible by upscale_factor'):
        pixel_shuffle_nhwc(torch.randn(1, 6, 2, 2), 2)
    with pytest.raises(ValueError, match='height and width divisible by downscale_factor'):
        pixel_unshuffle_nhwc(torch.randn(1, 6, 5, 4), 2)


@pytest.mark.parametrize('groups,affine', [(1, True), (4, True), (16, True), (4, False)])
def test_group_norm_matches(groups, affine):
    torch.manual_seed(0)
    norm = nn.GroupNorm(groups, 16, affine=affine, eps=1e-3)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    _compare_layers(norm, ChannelsLastGroupNorm, torch.randn(3, 16, 5, 6) * 3 + 1)


def test_group_norm_in_bfloat16_matches_within_bfloat16_rounding():
    norm = nn.GroupNorm(4, 16).to(torch.bfloat16)
    _compare_layers(norm, ChannelsLastGroupNorm, torch.randn(2, 16, 5, 5, dtype=torch.bfloat16), rtol=2e-2, atol=2e-2)


def test_group_norm_refuses_channels_that_groups_do_not_divide():
    with pytest.raises(ValueError, match='16 channels and 3 groups'):
        ChannelsLastGroupNorm(3, 15)(torch.randn(1, 16, 2, 2))


@pytest.mark.parametrize('affine', [True, False])
def test_instance_norm_matches(affine):
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(8, affine=affine)
    if affine:
        nn.init.normal_(norm.weight)
        nn.init.normal_(norm.bias)
    _compare_layers(norm, ChannelsLastInstanceNorm2d, torch.randn(2, 8, 7, 5) * 2 - 1)


def test_instance_norm_keeps_native_behaviour_outside_4d_input():
    norm = nn.InstanceNorm2d(4)
    swapped = copy.deepcopy(norm)
    swapped.__class__ = ChannelsLastInstanceNorm2d
    x = torch.randn(4, 5, 5)  # unbatched
    torch.testing.assert_close(swapped(x), norm(x))


@pytest.mark.parametrize('kwargs', [
    dict(scale_factor=2), dict(scale_factor=4, align_corners=True), dict(scale_factor=(2, 3)),
    dict(size=(9, 5)), dict(scale_factor=1.5, recompute_scale_factor=True), dict(scale_factor=0.5),
])
def test_bicubic_upsample_matches(kwargs):
    _compare_layers(nn.Upsample(mode='bicubic', **kwargs), ChannelsLastBicubicUpsample, torch.randn(2, 6, 8, 7))


def test_bicubic_upsample_above_the_matrix_size_limit_uses_the_native_kernel(monkeypatch):
    monkeypatch.setattr(bicubic_module, 'MATMUL_MAX_SIZE', 6)
    up = ChannelsLastBicubicUpsample(scale_factor=2, mode='bicubic')
    x = _nhwc(1, 2, 8, 8)
    assert torch.equal(up(x), F.interpolate(x, scale_factor=2, mode='bicubic'))
    torch.testing.assert_close(bicubic_upsample_nhwc(x, scale_factor=2), up(x), rtol=1e-5, atol=1e-6)


def test_global_pool_and_channel_interleave_match():
    x = torch.randn(2, 6, 5, 4)
    torch.testing.assert_close(global_avg_pool_nhwc(to_channels_last(x)), F.adaptive_avg_pool2d(x, 1))
    a, b = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert torch.equal(interleave_channels(a, b), channel_shuffle(torch.cat((a, b), dim=1), 2))


# the rule table and repair_model


def test_rules_skip_modules_whose_settings_they_do_not_cover():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.InstanceNorm2d(4, track_running_stats=True),
        nn.Upsample(scale_factor=2, mode='bilinear'),
        nn.AdaptiveAvgPool2d(2),
    )
    assert repair_model(model) == []


def test_subclasses_of_a_rule_type_are_left_alone():
    class MyPool(nn.AdaptiveAvgPool2d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Conv2d(3, 4, 3), MyPool(1))
    assert repair_model(model) == []


def test_repair_keeps_parameter_objects_hooks_and_pickles():
    model = UNet()
    params = list(model.parameters())
    calls = []
    hook = model.down1[1].register_forward_hook(lambda *args: calls.append(1))
    records = repair_model(model)
    assert [r for r in records if r.path == 'down1.1'] == [
        RepairRecord('down1.1', 'torch.nn.modules.instancenorm.InstanceNorm2d', 'instance_norm')]
    assert all(p is q for p, q in zip(params, model.parameters()))
    model(torch.randn(1, 3, 16, 16))
    assert calls == [1]
    hook.remove()  # a lambda does not pickle
    restored = pickle.loads(pickle.dumps(model))
    assert type(restored.down1[1]) is ChannelsLastInstanceNorm2d


def test_a_replacement_must_subclass_the_original():
    with pytest.raises(TypeError, match="repair rule 'bad'.*must subclass torch.nn.modules.conv.Conv2d"):
        RepairRule(name='bad', original=nn.Conv2d, replacement=nn.Identity, removes='nothing')
