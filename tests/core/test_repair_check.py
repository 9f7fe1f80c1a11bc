"""The repair check: each layer a repair rule swapped is compared with its original on its first call, on the
user's own batch, and put back where its output or gradients differ; the run then has the NCHW numbers."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from channels_last_algo.core import module_calls
from channels_last_algo.core.audit import LayoutAudit
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layers.group_norm_nhwc import ChannelsLastInstanceNorm2d
from channels_last_algo.core.repair_check import RepairCheck

CORRECT = ChannelsLastInstanceNorm2d.forward


def _wrong_output(self, x):
    return CORRECT(self, x) * 1.01


def _wrong_gradient(self, x):
    """The right output, a gradient 1.5 times too large."""
    out = CORRECT(self, x)
    return out.detach() + (out - out.detach()) * 1.5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.InstanceNorm2d(8, affine=True),
        nn.ReLU(),
        nn.Conv2d(8, 4, 3),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    ).double()


def _train(model, guard=None, steps=3):
    """Losses and weights after each of ``steps`` SGD steps on fixed batches."""
    if guard is not None:
        guard.on_init(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    history = []
    for step in range(steps):
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        if guard is None:
            loss = model(x).square().sum()
            loss.backward()
        else:
            with guard.step():
                loss = model(guard.on_batch(x)).square().sum()
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss.item(), [p.detach().clone() for p in model.parameters()]))
    return history


def _assert_same(actual, expected):
    for (loss, weights), (loss_ref, weights_ref) in zip(actual, expected):
        assert loss == pytest.approx(loss_ref, rel=1e-10)
        for w, w_ref in zip(weights, weights_ref):
            torch.testing.assert_close(w, w_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize('audit_steps', [0, 1])
def test_a_correct_repair_is_kept_and_trains_as_nchw(audit_steps):
    expected = _train(_model())
    model, guard = _model(), LayoutGuard(audit_steps=audit_steps)
    _assert_same(_train(model, guard), expected)
    assert type(model[1]) is ChannelsLastInstanceNorm2d
    assert guard.refused_repairs == []


@pytest.mark.parametrize(
    'replacement, what', [(_wrong_output, 'output differs'), (_wrong_gradient, 'gradient differs')]
)
@pytest.mark.parametrize('audit_steps', [0, 1, 2])
def test_a_repair_that_changes_a_result_is_taken_back_and_said(monkeypatch, caplog, replacement, what, audit_steps):
    monkeypatch.setattr(ChannelsLastInstanceNorm2d, 'forward', replacement)
    expected = _train(_model())
    model, guard = _model(), LayoutGuard(audit_steps=audit_steps)
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        _assert_same(_train(model, guard), expected)
    assert type(model[1]) is nn.InstanceNorm2d
    assert [(r.record.path, r.record.reason) for r in guard.refused_repairs] == [('1', 'instance_norm')]
    assert what in guard.refused_repairs[0].reason and 'tolerance 1e-09' in guard.refused_repairs[0].reason
    said = [r.getMessage() for r in caplog.records if 'not repaired' in r.getMessage()]
    assert len(said) == 1 and said[0].startswith('channels last: not repaired: 1 (instance_norm): ')
    assert [r.reason for r in guard.summary.repaired] == ['global_avg_pool']


def test_a_repair_that_returns_another_dtype_is_taken_back_though_its_values_are_equal(monkeypatch):
    """Equal values in another dtype change every op after the layer (a half activation made float32 under
    autocast runs the rest of the block in float32): the check compares dtypes too."""
    monkeypatch.setattr(ChannelsLastInstanceNorm2d, 'forward', lambda self, x: CORRECT(self, x).double())
    torch.manual_seed(0)
    model, guard = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.InstanceNorm2d(8, affine=True)), LayoutGuard()
    expected = copy.deepcopy(model)(torch.ones(2, 3, 8, 8))
    guard.on_init(model)
    with guard.step():
        output = model(guard.on_batch(torch.ones(2, 3, 8, 8)))
        output.sum().backward()
    assert type(model[1]) is nn.InstanceNorm2d and output.dtype == torch.float32
    torch.testing.assert_close(output, expected)
    assert guard.refused_repairs[0].reason == 'its output is torch.float64, the original torch.float32'


def test_a_first_call_without_gradients_checks_outputs_then_the_first_with_gradients(monkeypatch):
    monkeypatch.setattr(ChannelsLastInstanceNorm2d, 'forward', _wrong_gradient)
    model = _model()
    check = RepairCheck(model, apply_channels_last(model).repaired)
    check.start()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    with torch.no_grad():
        model(x)
    assert not check.done and check.refused == []
    model(x).sum().backward()
    assert check.done and 'gradient differs' in check.refused[0].reason


def test_the_check_leaves_buffers_random_state_and_audit_as_the_call_left_them():
    """BatchNorm statistics are updated once, the random stream advances as without the check, and the
    audit records the real call's ops only."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.InstanceNorm2d(8, track_running_stats=True), nn.Dropout()]
    reference = nn.Sequential(*layers).double()
    model = copy.deepcopy(reference)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    RepairCheck(model, apply_channels_last(model).repaired).start()
    plain = copy.deepcopy(reference).to(memory_format=torch.channels_last)
    torch.manual_seed(1)
    with LayoutAudit(plain) as plain_audit:
        expected = plain(x.to(memory_format=torch.channels_last))
    after_plain = torch.rand(1)
    torch.manual_seed(1)
    with LayoutAudit(model) as audit:
        actual = model(x.to(memory_format=torch.channels_last))
    assert torch.rand(1) == after_plain
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    for buffer, buffer_ref in zip(model.buffers(), plain.buffers()):
        torch.testing.assert_close(buffer, buffer_ref, rtol=1e-12, atol=0)
    assert len(audit.report.breaks) <= len(plain_audit.report.breaks)


def test_in_evaluation_mode_the_first_call_ends_the_check_and_takes_the_hooks_off():
    """Inference only: the outputs are checked, and no hook stays on (torch 2.7's strict torch.export
    fails while any global module hook is on)."""
    model = _model().eval()
    check = RepairCheck(model, apply_channels_last(model).repaired)
    check.start()
    with torch.no_grad():
        model(torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last))
    assert check.done and check.refused == []
    assert not module_calls.tracking(check)


def test_graph_capture_is_not_checked_and_the_next_plain_call_is():
    model = _model()
    check = RepairCheck(model, apply_channels_last(model).repaired)
    check.start()
    x = torch.randn(1, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)
    torch.jit.trace(model, x, check_trace=False)  # no eager rerun to compare
    assert not check.done
    model(x).sum().backward()
    assert check.done and check.refused == []


def test_layers_of_a_compiled_model_end_their_check_at_its_first_call():
    """Inside torch.compile's graph no layer is called eagerly: the check ends, and lets go of them."""
    model = _model()
    check = RepairCheck(model, apply_channels_last(model).repaired)
    check.start()
    compiled = torch.compile(model, backend='eager')
    compiled(torch.randn(2, 3, 8, 8, dtype=torch.float64).to(memory_format=torch.channels_last)).sum().backward()
    assert check.done and check.refused == []
    assert not module_calls.tracking(check)
