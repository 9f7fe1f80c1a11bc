"""The op repair: NHWC kept through the functional ops of modules with breaks that no rule removes,
the model's own forward included, with the same numbers, Parameters, state_dict keys, and use with
fx, TorchScript, torch.export and ONNX."""

import copy
import gc
import io
import pickle

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from channels_last_algo.core import op_repair
from channels_last_algo.core.audit import FALLBACK_OP, AuditReport, audit_model
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layout import is_channels_last, to_channels_last
from channels_last_algo.core.op_repair import (
    OP_REPAIR_RULE,
    _leave_module,
    has_op_repair,
    prune_op_repairs,
    remove_op_repairs,
    repair_ops,
)


class Flatten3(nn.Module):
    """Drops NHWC in forward: a functional round trip through a channels-first copy."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x.contiguous()) * 2


class MeanPool(nn.Module):
    """Its gradient comes back NCHW (a functional global mean), so the SiLU before it breaks in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        Flatten3(),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.SiLU(),
        MeanPool(),
        nn.Linear(8, 4),
    ).double()


def _x(shape=(2, 3, 10, 10)):
    return to_channels_last(torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))


def _fallen_back():
    """(NCHW reference, converted model with the fallback, input, audit before, audit after)."""
    reference = _model()
    model = copy.deepcopy(reference)
    apply_channels_last(model)
    x = _x()
    before = audit_model(model, x)
    records = repair_ops(model, before)
    after = audit_model(model, x)
    prune_op_repairs(model, after)
    return reference, model, x, before, records, after


def _step(model, x):
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.backward(torch.ones_like(out))
    return out, x.grad, {name: p.grad for name, p in model.named_parameters()}


def test_fallback_goes_where_the_audit_found_breaks_and_the_rest_stays_nhwc():
    _, model, x, before, records, after = _fallen_back()
    assert {(b.module_path, b.phase) for b in before.breaks} == {('1', 'forward'), ('3', 'backward'), ('5', 'backward')}
    assert all(r.reason == OP_REPAIR_RULE and r.detail.startswith('keeps NHWC through') for r in records)
    assert {r.path for r in records} == {'1', '3', '5'}
    # '3' (the ReLU's backward) broke only because of '5': pruned, as it changed nothing
    assert has_op_repair(model[1]) and has_op_repair(model[5]) and not has_op_repair(model[3])
    _, x_grad, grads = _step(model, x)
    assert is_channels_last(x_grad) and all(is_channels_last(g) for g in grads.values() if g.dim() == 4)
    assert after.breaks == []
    # '1' keeps its .contiguous() NHWC (no copy back); '5' copies the mean's NCHW gradient once
    assert [(r.module_path, r.phase) for r in after.fallbacks] == [('5', 'backward')]
    assert all(r.op == FALLBACK_OP.replace('::', '.') + '.default' and r.nbytes > 0 for r in after.fallbacks)
    assert after.fallback_bytes == sum(r.nbytes for r in after.fallbacks)


def test_fallback_keeps_numbers_parameters_and_keys():
    reference = _model()
    model = copy.deepcopy(reference)
    params = list(model.parameters())
    apply_channels_last(model)
    repair_ops(model, audit_model(model, _x()))
    assert all(p is q for p, q in zip(params, model.parameters()))
    assert list(model.state_dict()) == list(reference.state_dict())
    expected, actual = _step(reference, _x().contiguous()), _step(model, _x())
    for a, e in zip(actual[:2], expected[:2]):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for name, grad in expected[2].items():
        torch.testing.assert_close(actual[2][name], grad, rtol=1e-12, atol=1e-12, msg=name)
    assert has_op_repair(pickle.loads(pickle.dumps(model))[1])  # the hooks travel with the model


def test_fallback_keeps_fx_script_export_and_onnx():
    reference, model, x, *_ = _fallen_back()
    reference.eval(), model.eval()
    with torch.no_grad():
        expected = reference(x.contiguous())
        torch.testing.assert_close(torch.fx.symbolic_trace(model)(x), expected)
        torch.testing.assert_close(torch.jit.script(model)(x), expected)
        torch.testing.assert_close(torch.export.export(model, (x,)).module()(x), expected)
    onnx = pytest.importorskip('onnx')
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, dynamo=False)
    onnx.checker.check_model(onnx.load_from_string(buffer.getvalue()))


def test_prune_and_remove_take_the_hooks_off():
    _, model, x, _, records, after = _fallen_back()
    kept = [path for path, module in model.named_modules() if has_op_repair(module)]
    assert kept == ['1', '5'] and set(kept) < {r.path for r in records}
    assert remove_op_repairs(model) == kept
    assert not any(has_op_repair(m) for m in model.modules())
    gc.collect()  # the models of earlier tests, which may still hold the policy
    if not list(op_repair._REPAIRED):  # the process-wide hooks go with the last repaired module
        assert _leave_module not in module_hooks._global_forward_hooks.values()
    assert len(audit_model(model, x).breaks) == 3


def test_no_break_no_op_repair():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double()
    apply_channels_last(model)
    assert repair_ops(model, audit_model(model, _x())) == []


def test_report_round_trips_with_fallbacks():
    *_, after = _fallen_back()
    assert AuditReport.from_dict(after.to_dict()) == after
    assert 'op repair copies' in str(after)


def test_guard_installs_the_fallback_after_the_first_audited_step_and_prunes_after_the_next():
    model = _model()
    guard = LayoutGuard(audit_steps=2)
    guard.on_init(model)
    reports = []
    for _ in range(3):
        x = guard.on_batch(_x().contiguous())
        with guard.step():
            model(x).sum().backward()
        reports.append(guard.report)
    first, second = reports[0], AuditReport(breaks=reports[1].breaks[len(reports[0].breaks) :])
    assert first.fallbacks == [] and guard.op_repairs
    assert len(second.breaks) < len(first.breaks)
    assert second.breaks == [] and {r.path for r in guard.op_repairs} == {'1', '5'}
    remove_op_repairs(model)
    assert LayoutGuard(audit_steps=2, repair=False).op_repairs == []


class RootBreaks(nn.Module):
    """Breaks in the model's own forward: a channel slice, a contiguous() viewed as tokens and back,
    an in-place add into a channel slice, and a functional global mean."""

    def __init__(self):
        super().__init__()
        self.stem, self.mix, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        b, c, h, w = x.shape
        tokens = x.contiguous().view(b, c, h * w)  # the view needs the NCHW order
        x = x + tokens.view(b, c, h, w).sigmoid()
        y = x.clone()
        y[:, :4] += self.mix(x[:, 4:])
        return self.head(y.mean((2, 3)))


def _repaired(model, x):
    apply_channels_last(model)
    before = audit_model(model, x)
    records = repair_ops(model, before)
    prune_op_repairs(model, audit_model(model, x), before)
    return before, records


def test_breaks_in_the_models_own_forward_are_repaired_with_the_same_numbers(double_precision):
    torch.manual_seed(0)
    reference, x = RootBreaks(), _x()
    model = copy.deepcopy(reference)
    before, records = _repaired(model, x)
    assert before.breaks and [r.path for r in records] == ['']
    after = audit_model(model, x)
    assert after.breaks == [] and has_op_repair(model)
    expected, actual = _step(reference, x.contiguous()), _step(model, x)
    for a, e in zip(actual[:2], expected[:2]):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for name, grad in expected[2].items():
        torch.testing.assert_close(actual[2][name], grad, rtol=1e-12, atol=1e-12, msg=name)
    assert is_channels_last(actual[1]) and is_channels_last(actual[2]['stem.weight'])
    copied = copy.deepcopy(model)  # an EMA copy, say: the policy goes with it
    assert has_op_repair(copied) and audit_model(copied, x).breaks == []
    remove_op_repairs(model)
    remove_op_repairs(copied)


def test_the_policy_stays_out_of_graph_capture(double_precision):
    torch.manual_seed(0)
    reference, x = RootBreaks().eval(), _x()
    model = copy.deepcopy(reference)
    _repaired(model, x)
    captures = {'trace': lambda m: torch.jit.trace(m, x), 'script': torch.jit.script}
    with torch.no_grad():
        expected = reference(x.contiguous())
        with pytest.raises(TypeError, match='Proxy'):  # the slice assignment: fx cannot trace the original
            torch.fx.symbolic_trace(reference)
        for capture in captures.values():
            torch.testing.assert_close(capture(model)(x), expected)
        exported = torch.export.export(model, (x,), strict=False)
    assert 'restore_channels_last' not in str(exported.graph)
    torch.testing.assert_close(exported.module()(x), expected)
    remove_op_repairs(model)
