"""The layout audit: what it finds in torchvision models on torch 2.7 CPU, where it says the
break is, strict mode, the report, and the ``channels-last audit`` command."""

import json
import warnings
from collections import OrderedDict

import pytest
import torch
import torchvision
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils import _python_dispatch

from channels_last_algo.core.audit import AuditRecord, AuditReport, LayoutAudit, LayoutBreakError
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.layout import to_channels_last
from channels_last_algo.core.model_audit import audit_model
from conftest import DropsNHWC, forward_break_net

ZOO_INPUT = (1, 3, 64, 64)  # small, but large enough that the last stage is 2x2 (not ambiguous)


def _nhwc(*shape):
    return to_channels_last(torch.randn(*shape))


@pytest.fixture(scope='module')
def zoo():
    """``zoo(name)`` -> (channels-last model, its audit report); each built and audited once."""
    cache = {}

    def get(name):
        if name not in cache:
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter('ignore', FutureWarning)  # googlenet's init_weights notice
                model = getattr(torchvision.models, name)(weights=None)
            apply_channels_last(model, repair=False)
            cache[name] = model, audit_model(model, _nhwc(*ZOO_INPUT))
        return cache[name]

    return get


def _found(report):
    return {(r.op, r.module_path, r.phase) for r in report.breaks}


# torchvision models, channels last, forward + backward


def test_resnet50_has_no_break_and_a_free_exit(zoo):
    _, report = zoo('resnet50')
    assert report.ok and report.breaks == []
    assert report.exits == [AuditRecord('aten.view.default', '', 'forward', (1, 2048, 1, 1), 0, 'ambiguous->2D')]


def test_shufflenet_breaks_in_cat_of_every_non_downsampling_block(zoo):
    model, report = zoo('shufflenet_v2_x1_0')
    blocks = (
        [f'stage2.{i}' for i in range(1, 4)]
        + [f'stage3.{i}' for i in range(1, 8)]
        + [f'stage4.{i}' for i in range(1, 4)]
    )
    assert _found(report) == {('aten.cat.default', b, phase) for b in blocks for phase in ('forward', 'backward')}
    assert len(report.breaks) == 2 * len(blocks)
    assert all(type(model.get_submodule(b)).__name__ == 'InvertedResidual' for b in blocks)
    assert report.exits == []  # its head is a mean over H, W: no reshape


def test_efficientnet_breaks_in_silu_backward_of_the_last_conv_block(zoo):
    model, report = zoo('efficientnet_b0')
    assert _found(report) == {('aten.silu_backward.default', 'features.8.2', 'backward')}
    assert isinstance(model.get_submodule('features.8.2'), nn.SiLU)
    assert report.breaks[0].shape == (1, 1280, 2, 2) and report.breaks[0].nbytes == 1280 * 4 * 4


def test_mobilenet_v3_breaks_in_hardswish_backward_of_the_last_conv_block(zoo):
    model, report = zoo('mobilenet_v3_large')
    assert _found(report) == {('aten.hardswish_backward.default', 'features.16.2', 'backward')}
    assert isinstance(model.get_submodule('features.16.2'), nn.Hardswish)


def test_convnext_breaks_in_layer_scale_mul_and_gradient_add(zoo):
    model, report = zoo('convnext_tiny')
    blocks = [f'features.7.{i}' for i in range(3)]
    assert _found(report) == (
        {('aten.mul.Tensor', b, 'backward') for b in blocks}
        | {('aten.add.Tensor', f'{b}.block.0', 'backward') for b in blocks}
    )
    assert all(type(model.get_submodule(b)).__name__ == 'CNBlock' for b in blocks)


def test_googlenet_clones_are_exits_of_its_aux_heads_not_breaks(zoo):
    _, report = zoo('googlenet')
    assert report.ok
    copies = [(e.op, e.module_path, e.nbytes) for e in report.exits if e.nbytes]
    assert copies == [('aten.clone.default', 'aux1', 128 * 4 * 4 * 4), ('aten.clone.default', 'aux2', 128 * 4 * 4 * 4)]
    assert [(e.op, e.module_path, e.shape) for e in report.exits if not e.nbytes] == [
        ('aten.view.default', '', (1, 1024, 1, 1))
    ]


def test_vgg11_bn_clone_is_the_exit_before_its_classifier(zoo):
    _, report = zoo('vgg11_bn')
    assert report.ok
    assert report.exits == [
        AuditRecord('aten.clone.default', '', 'forward', (1, 512, 7, 7), 512 * 7 * 7 * 4, 'NHWC->NCHW->2D')
    ]


def test_strict_raises_at_the_first_break_with_its_module_path(zoo):
    model, _ = zoo('shufflenet_v2_x1_0')
    with pytest.raises(LayoutBreakError, match=r"forward at module 'stage2\.1' \(InvertedResidual\): aten\.cat"):
        audit_model(model, _nhwc(*ZOO_INPUT), strict=True)
    assert _python_dispatch._get_current_dispatch_mode() is None


def test_report_json_round_trips_and_prints_a_table(zoo):
    _, report = zoo('convnext_tiny')
    assert AuditReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    text = str(report)
    assert text.splitlines()[0] == (
        'layout audit over 1 step: 6 layout breaks (72.0 KiB moved), 1 exit conversions (0 B copied)'
    )
    row = [line.split() for line in text.splitlines() if 'features.7.2 ' in line][0]
    assert row == [
        'backward',
        'features.7.2',
        'aten.mul.Tensor',
        '(1,',
        '768,',
        '2,',
        '2)',
        'NHWC->NCHW',
        '1',
        '12.0',
        'KiB',
    ]
    assert 'classifier.1' in text and 'ambiguous->2D' in text


# hand-made models: attribution, exits, the context object


class _DropInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()  # keeps NHWC

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()  # the gradient leaves NHWC


class _BackwardDrop(nn.Module):
    def forward(self, x):
        return _DropInBackward.apply(x)


def _backward_break_net():
    return nn.Sequential(OrderedDict(stem=nn.Conv2d(3, 8, 3, padding=1), drop=_BackwardDrop(), head=nn.Conv2d(8, 4, 3)))


def _converted(factory):
    torch.manual_seed(0)
    model = factory()
    apply_channels_last(model, repair=False)
    return model


def test_forward_breaks_are_attributed_to_the_running_module():
    report = audit_model(_converted(forward_break_net), _nhwc(2, 3, 8, 8))
    assert [(r.op, r.module_path, r.phase, r.layouts, r.nbytes) for r in report.breaks] == [
        ('aten.clone.default', 'body.1', 'forward', 'NHWC->NCHW', 2 * 8 * 8 * 8 * 4),
        ('aten._to_copy.default', 'body.2', 'forward', 'NCHW->NHWC', 2 * 8 * 8 * 8 * 4),
    ]


def test_a_torchscript_model_is_audited_where_it_can_be_told_apart():
    """No module hook runs inside TorchScript, so a forward break there is the scripted model's own ('');
    a TorchScript module has no ``get_submodule``, and the audit does not need one."""
    net = forward_break_net()
    apply_channels_last(net)
    report = audit_model(torch.jit.script(net), _nhwc(2, 3, 8, 8))
    forward = [(r.op, r.module_path) for r in report.breaks if r.phase == 'forward']
    assert forward == [('aten.clone.default', ''), ('aten._to_copy.default', '')]


def test_backward_only_break_is_attributed_to_the_module_that_made_the_node():
    report = audit_model(_converted(_backward_break_net), _nhwc(2, 3, 8, 8))
    assert [(r.op, r.module_path, r.phase) for r in report.breaks] == [('aten.clone.default', 'drop', 'backward')]
    with pytest.raises(LayoutBreakError, match=r"backward at module 'drop' \(_BackwardDrop\): aten\.clone"):
        audit_model(_converted(_backward_break_net), _nhwc(2, 3, 8, 8), strict=True)


def test_flatten_is_an_exit_with_bytes_when_it_copies_and_free_after_pooling():
    flat = _converted(lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 2)))
    report = audit_model(flat, _nhwc(2, 3, 8, 8))
    assert report.ok
    assert [(e.op, e.module_path, e.nbytes) for e in report.exits] == [('aten.clone.default', '1', 2 * 8 * 6 * 6 * 4)]
    pooled = _converted(
        lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))
    )
    report = audit_model(pooled, _nhwc(2, 3, 8, 8))
    assert report.ok
    assert [(e.op, e.module_path, e.nbytes) for e in report.exits] == [('aten.view.default', '2', 0)]


def test_input_conversion_outside_the_model_is_not_a_break():
    model = _converted(lambda: nn.Conv2d(3, 4, 3))
    with LayoutAudit(model) as audit:
        model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    assert audit.report.ok


def test_a_drop_outside_the_model_is_listed_apart_and_not_a_break():
    model = _converted(lambda: nn.Conv2d(3, 4, 3))
    with LayoutAudit(model, strict=True) as audit:  # strict raises on the model's breaks only
        output = model(_nhwc(2, 3, 8, 8))
        output.contiguous().sum().backward()  # NHWC -> NCHW outside the model, as a loss might
    report = audit.report
    assert report.ok and report.breaks == []
    assert [(r.op, r.module_path, r.phase) for r in report.outside] == [('aten.clone.default', None, 'forward')]
    assert 'outside the model' in str(report) and 'no layout breaks' in str(report)
    assert AuditReport.from_dict(report.to_dict()) == report
    assert AuditReport.merge([report, report]).outside == report.outside * 2


def test_audit_model_leaves_parameters_buffers_and_grads_as_they_were():
    model = _converted(lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), DropsNHWC()))
    model[0].weight.grad = old_grad = torch.ones_like(model[0].weight)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    audit_model(model, _nhwc(2, 3, 8, 8))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert model[0].weight.grad is old_grad and torch.equal(old_grad, torch.ones_like(old_grad))
    assert model[0].bias.grad is None and model[1].weight.grad is None


@pytest.fixture
def avx2(monkeypatch):
    """Every model trains on an AVX2 CPU with this torch, where oneDNN's 1x1 strided weight gradient hangs or
    crashes below 8 input channels (``onednn_1x1_strided_weight_grad``)."""
    import dataclasses

    from channels_last_algo.core.runtime import Runtime
    from channels_last_algo.core.safety import bugs

    cpu = dataclasses.replace(Runtime.current('cpu'), cpu_isa='AVX2')
    monkeypatch.setattr(bugs, 'default_runtimes', lambda model: [cpu])


def test_audit_refuses_a_layer_that_crashes_channels_last_before_it_runs(avx2):
    """Plain ``model.to(channels_last)`` of a RepVGG-style stem (a 1x1 stride-2 branch over 3 channels) hung or
    killed the process in the audit's backward on an AVX2 CPU; the audit names the layer and the fix first."""
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Sequential(nn.ReLU(), nn.Conv2d(3, 16, 1, 2)))
    model = model.to(memory_format=torch.channels_last)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    from channels_last_algo.core.safety import KernelBugError

    with pytest.raises(
        KernelBugError,
        match=r"audit_model: layer '1\.1' \(Conv2d\) of Sequential .*"
        r'onednn_1x1_strided_weight_grad .*apply_channels_last\(model\)',
    ):
        audit_model(model, _nhwc(2, 3, 8, 8))
    assert calls == []  # refused before anything ran
    audit_model(nn.Sequential(model[1][1]), _nhwc(2, 3, 8, 8), backward=False)  # the bug is in the backward only
    audit_model(nn.Sequential(nn.Conv2d(3, 16, 1, 2)), torch.randn(2, 3, 8, 8))  # NCHW (a 1x1 weight is both)
    plain = nn.Sequential(nn.Conv2d(3, 16, 1, 2))
    apply_channels_last(plain)
    assert audit_model(plain, _nhwc(2, 3, 8, 8)).ok  # on its safe path


def test_audit_spans_per_step_merge_into_the_whole_report_and_leave_nothing_installed():
    model = _converted(forward_break_net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pre_hooks, hooks = len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)
    audit = LayoutAudit(model)
    step_reports = []
    for _ in range(2):
        audit.start()
        assert _python_dispatch._get_current_dispatch_mode() is not None
        optimizer.zero_grad()
        model(_nhwc(2, 3, 8, 8)).sum().backward()
        optimizer.step()
        step_reports.append(audit.stop())
        assert _python_dispatch._get_current_dispatch_mode() is None
        assert (len(module_hooks._global_forward_pre_hooks), len(module_hooks._global_forward_hooks)) == (
            pre_hooks,
            hooks,
        )
    assert [len(r.breaks) for r in step_reports] == [2, 2]
    assert AuditReport.merge(step_reports) == audit.report
    assert audit.report.steps == 2 and '2 steps' in str(audit.report)
    with pytest.raises(RuntimeError, match='not active'):
        audit.stop()


def test_report_from_dict_names_the_bad_key():
    with pytest.raises(ValueError, match=r'breaks\[0\]'):
        AuditReport.from_dict({'steps': 1, 'breaks': [{'op': 'aten.cat.default'}], 'exits': []})
    with pytest.raises(ValueError, match='exits'):
        AuditReport.from_dict({'steps': 1, 'breaks': []})
