"""Repair: every rule removes the break it names where its row says the break exists (a probe
on the installed torch), rules apply where their row says, and ``repair_model`` leaves alone what
no rule covers. The torchvision zoo and the UNet of the benchmarks, repaired: app/test_repaired_zoo.py."""

import pytest
import torch
from torch import nn
from torchvision.models.mobilenetv2 import MobileNetV2
from torchvision.models.shufflenetv2 import InvertedResidual

from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layers import (
    RULES,
    ChannelsLastAdaptiveAvgPool2d,
    RepairRule,
    repair_model,
    unrepaired_subclasses,
)
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.model_audit import audit_model
from channels_last_algo.core.runtime import Runtime, version_in
from channels_last_algo.core.safety import make_safe
from channels_last_algo.core.swap import Replacement
from channels_last_algo.core.swap_records import UncoveredLayer


def _nhwc(*shape, dtype=torch.float32):
    return to_channels_last(torch.randn(*shape, dtype=dtype))


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
    # kernel safe paths for this CPU only: with a CUDA device present, a CPU model would also take the
    # CUDA rows' paths (it may move there), and the NCHW average pool of one adds the breaks it reports
    apply_channels_last(model, repair=False, kernel_safety=False)
    make_safe(model, runtimes=[Runtime.current('cpu')])
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


def test_a_layer_other_code_hooks_forward_and_backward_keeps_its_class_and_is_named():
    """Code that extends a layer's backward (a forward and a backward hook) may look its handling up by
    ``type(module)`` (Opacus, BackPACK): the layer is not repaired. A forward hook alone (a logger's), and the
    package's own hooks (a viewed output made channels first), do not count."""
    from channels_last_algo.core.channels_first_outputs import make_outputs_channels_first

    for forward, backward in (
        ('register_forward_hook', 'register_full_backward_hook'),
        ('register_forward_pre_hook', 'register_full_backward_pre_hook'),
    ):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1))
        getattr(model[1], forward)(print)
        getattr(model[1], backward)(print)
        summary = apply_channels_last(model)
        assert type(model[1]) is nn.AdaptiveAvgPool2d and summary.repaired == [], forward
        assert summary.not_covered == [
            UncoveredLayer('1', 'repair', 'global_avg_pool', 'torch.nn.modules.pooling.AdaptiveAvgPool2d', (), True)
        ]
    for one_tensor in (True, False):  # the package's hook TorchScript compiles, and the one for any outputs
        hooked = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1))
        hooked[1].register_full_backward_hook(print)
        make_outputs_channels_first(hooked[1], one_tensor)
        assert [r.path for r in repair_model(hooked)] == ['1'] and unrepaired_subclasses(hooked) == []
    logged = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1))
    logged[1].register_forward_hook(print)
    assert [r.path for r in repair_model(logged)] == ['1']


def test_a_replacement_must_subclass_the_original_and_the_replacement_base():
    with pytest.raises(TypeError, match="repair rule 'bad'.*must subclass torch.nn.modules.conv.Conv2d"):
        RepairRule(name='bad', breaks='none', original=nn.Conv2d, replacement=nn.Identity, removes='nothing')

    class PlainConv(nn.Conv2d):
        pass

    with pytest.raises(TypeError, match="'bad'.*must subclass channels_last_algo.core.swap.Replacement, then"):
        RepairRule(name='bad', breaks='none', original=nn.Conv2d, replacement=PlainConv, removes='nothing')
