"""LayoutGuard in a plain loop: conversion, NHWC batches and the audit of training steps."""

import copy

import pytest
import torch
from torch import nn

from channels_last_algo import (
    LayoutBreakError,
    LayoutGuard,
    batch_to_channels_last,
    has_channels_last_strides,
)
from conftest import TinyResNet, breaking_model, no_dispatch_mode, random_images, tiny_loader


def test_plain_loop_audits_the_first_steps_then_installs_nothing():
    model = TinyResNet()
    guard = LayoutGuard(audit_steps=2)
    guard.on_init(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    modes = []
    model.register_forward_pre_hook(lambda mod, args: modes.append(not no_dispatch_mode()))
    for images, labels in tiny_loader(n=12):
        images, labels = guard.on_batch((images, labels))
        with guard.step():
            nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert modes == [True, True, False]
    report = guard.report
    assert report.steps == 2 and report.ok
    # the flatten of the globally pooled N x C x 1 x 1 tensor: a free exit, once per step
    assert [(e.module_path, e.op, e.nbytes) for e in report.exits] == [('', 'aten.view.default', 0)] * 2
    assert no_dispatch_mode()


def test_plain_loop_strict_names_the_module_and_leaves_nothing_installed():
    model = breaking_model()
    guard = LayoutGuard(audit_steps=1, strict=True)
    guard.on_init(model)
    images, labels = guard.on_batch(next(iter(tiny_loader())))
    with pytest.raises(LayoutBreakError, match="module '1'"):
        with guard.step():
            nn.functional.cross_entropy(model(images), labels).backward()
    assert no_dispatch_mode()
    assert guard.report.breaks[0].module_path == '1'


def test_an_exception_inside_an_audited_step_stops_the_audit():
    model = TinyResNet()
    guard = LayoutGuard(audit_steps=3)
    guard.on_init(model)
    with pytest.raises(ZeroDivisionError):
        with guard.step():
            model(guard.on_batch(torch.randn(2, 3, 16, 16)))
            raise ZeroDivisionError
    assert no_dispatch_mode()


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_ten_sgd_steps_match_nchw_and_stay_channels_last(dtype):
    # fp32: the losses agree to float tolerance; fp64 shows the weights agree exactly (the
    # fp32 spread is summation order, amplified in near-zero BN biases over the steps).
    torch.manual_seed(0)
    base = TinyResNet(width=16).to(dtype)
    converted = copy.deepcopy(base)
    guard = LayoutGuard()
    guard.on_init(converted)
    opt_base = torch.optim.SGD(base.parameters(), lr=0.05, momentum=0.9)
    opt_cl = torch.optim.SGD(converted.parameters(), lr=0.05, momentum=0.9)
    four_d = [p for p in converted.parameters() if p.dim() == 4]
    assert four_d

    for step in range(10):
        images, labels = random_images(n=8, seed=step)
        images = images.to(dtype)
        losses = []
        for model, optimizer, batch in (
            (base, opt_base, (images, labels)),
            (converted, opt_cl, guard.on_batch((images, labels))),
        ):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5, msg=f'loss at step {step}')
        for p in four_d:
            assert has_channels_last_strides(p), f'weight at step {step}'
            assert has_channels_last_strides(p.grad), f'gradient at step {step}'
            assert has_channels_last_strides(opt_cl.state[p]['momentum_buffer']), f'momentum at step {step}'
    if dtype == torch.float64:
        for (name, a), b in zip(base.named_parameters(), converted.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)


def test_batch_conversion_makes_no_copy_when_already_nhwc():
    images = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    labels = torch.arange(2)
    out = batch_to_channels_last([images, labels])
    assert out[0] is images and out[1] is labels


def test_a_segmentation_loss_outside_the_model_is_no_break_under_strict():
    """cross_entropy's log_softmax turns the N x C x H x W NHWC output NCHW: the loss's, not the model's."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 1))
    guard = LayoutGuard(audit_steps=1, strict=True)
    guard.on_init(model)
    images, masks = guard.on_batch((torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2, 8, 8))))
    with guard.step():
        nn.functional.cross_entropy(model(images), masks).backward()
    assert guard.report.ok and guard.report.breaks == []
    assert [(r.op, r.module_path) for r in guard.report.outside] == [('aten._log_softmax.default', None)]
    assert guard.audit_block.lines[0] == 'channels last: layout audit of 1 training step: no layout breaks'


class _FunctionalConvolution(nn.Module):
    """A convolution through ``F.conv2d`` of a weight no convolution module owns: left as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))

    def forward(self, x):
        return nn.functional.conv2d(x, self.weight).relu().mean((2, 3))


@pytest.mark.parametrize('mode', ['on', 'auto'])
@pytest.mark.parametrize(
    'build',
    [
        lambda: torch.jit.script(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1))),
        _FunctionalConvolution,
    ],
    ids=['torchscript', 'functional'],
)
def test_batches_go_as_they_come_where_nothing_in_the_model_is_channels_last(build, mode):
    """NHWC batches into a model whose weights all stay channels first (TorchScript's, or no convolution's) would
    only add layout copies to each step: the batches go as they come, auto mode has nothing to time, no step is
    audited, and the start block says so."""
    model = build()
    guard = LayoutGuard(mode=mode, audit_steps=1)
    with pytest.warns(UserWarning, match='the model was left as it is'):
        guard.on_init(model)
    for _ in range(2):
        images, labels = guard.on_batch((torch.randn(2, 3, 8, 8), torch.arange(2)))
        assert images.is_contiguous()
        with guard.step():
            model(images).sum().backward()
    assert not guard.channels_last and guard.effective_mode == 'on' and guard.report is None
    lines = guard.start_block.lines
    assert '  batches     as they come: no tensor of the model is channels last to feed' in lines, lines
    assert not any(line.startswith('  audit') for line in lines), lines
