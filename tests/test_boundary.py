"""The boundary fallback: NHWC restored around modules with breaks that no rule removes, with the
same numbers, Parameters, state_dict keys, and use with fx, TorchScript, torch.export and ONNX."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from channels_last_algo.core.audit import FALLBACK_OP, AuditReport, audit_model
from channels_last_algo.core.boundary import (
    BOUNDARY_RULE,
    has_boundary,
    prune_boundaries,
    remove_boundaries,
    repair_breaks,
)
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.layout import is_channels_last, to_channels_last


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
    records = repair_breaks(model, before)
    after = audit_model(model, x)
    prune_boundaries(model, after)
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
    assert all(r.rule == BOUNDARY_RULE and r.detail.startswith('restores NHWC around') for r in records)
    assert has_boundary(model[1]) and has_boundary(model[5]) and not has_boundary(model[4])
    _, x_grad, grads = _step(model, x)
    assert is_channels_last(x_grad) and all(is_channels_last(g) for g in grads.values() if g.dim() == 4)
    assert {(r.module_path, r.phase) for r in after.fallbacks} == {('1', 'forward'), ('5', 'backward')}
    assert all(r.op == FALLBACK_OP.replace('::', '.') + '.default' and r.nbytes > 0 for r in after.fallbacks)
    assert after.fallback_bytes == sum(r.nbytes for r in after.fallbacks)
    # what stays is inside the modules with a boundary, and no more than before
    assert {(b.module_path, b.op) for b in after.breaks} == {
        ('1', 'aten.clone.default'),
        ('5', 'aten.silu_backward.default'),
    }


def test_fallback_keeps_numbers_parameters_and_keys():
    reference = _model()
    model = copy.deepcopy(reference)
    params = list(model.parameters())
    apply_channels_last(model)
    repair_breaks(model, audit_model(model, _x()))
    assert all(p is q for p, q in zip(params, model.parameters()))
    assert list(model.state_dict()) == list(reference.state_dict())
    expected, actual = _step(reference, _x().contiguous()), _step(model, _x())
    for a, e in zip(actual[:2], expected[:2]):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for name, grad in expected[2].items():
        torch.testing.assert_close(actual[2][name], grad, rtol=1e-12, atol=1e-12, msg=name)
    assert has_boundary(pickle.loads(pickle.dumps(model))[1])  # the hooks travel with the model


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
    kept = [path for path, module in model.named_modules() if has_boundary(module)]
    assert set(kept) == {r.module_path for r in after.fallbacks} and set(kept) < {r.path for r in records}
    assert remove_boundaries(model) == kept
    assert not any(has_boundary(m) or m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert audit_model(model, x).fallbacks == []


def test_no_break_no_boundary():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).double()
    apply_channels_last(model)
    assert repair_breaks(model, audit_model(model, _x())) == []


def test_report_round_trips_with_fallbacks():
    *_, after = _fallen_back()
    assert AuditReport.from_dict(after.to_dict()) == after
    assert 'boundary fallback copies' in str(after)


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
    assert first.fallbacks == [] and guard.boundaries
    assert len(second.breaks) < len(first.breaks)
    assert {r.path for r in guard.boundaries} == {r.module_path for r in reports[1].fallbacks}
    assert LayoutGuard(audit_steps=2, repair=False).boundaries == []
