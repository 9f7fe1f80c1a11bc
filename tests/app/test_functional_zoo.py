"""Breaks written as functional calls and tensor ops: the small nets of ``benchmarks/functional_models.py``
(channel slices, a cat with an NCHW branch, attention and window reshapes, functional means, pooled and
split concatenation, in-place updates; some in the model's own forward), each holding breaks of its class
after ``apply_channels_last``.

No layer swap can remove such a break without rewriting the user's ops, so each is left as written and
named. Asserted per model: the audit names every break with its module path; the conversion leaves no
more breaks than plain ``model.to(memory_format=torch.channels_last)``; the float64 step equals the NCHW
model's (outputs, input gradient, weight gradients); the same ``Parameter`` objects and ``state_dict``
keys; and fx, TorchScript (script and trace) and ``torch.export`` give the NCHW model's outputs wherever
they work on the original.
"""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import zoo_models as zoo
from benchmarks.functional_models import FUNCTIONAL_ZOO
from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.model_audit import audit_model

pytestmark = pytest.mark.slow  # a sweep of the functional zoo (deselect with -m 'not slow')

CAPTURES = {
    'fx': lambda m, x: torch.fx.symbolic_trace(m),
    'script': lambda m, x: torch.jit.script(m),
    'trace': lambda m, x: torch.jit.trace(m, x),
    'export': lambda m, x: torch.export.export(m, (x,), strict=False).module(),
}


def _step(model, x):
    x = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.backward(torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1)))
    return out.detach(), x.grad, {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture(params=FUNCTIONAL_ZOO, ids=lambda entry: entry.name)
def converted(request):
    """(entry, float64 NCHW reference, float64 converted model, NHWC input)."""
    entry = request.param
    reference = zoo.build(entry).double()
    model = copy.deepcopy(reference)
    apply_channels_last(model)
    x = torch.randn(*entry.input_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return entry, reference, model, x.to(memory_format=torch.channels_last)


def test_every_break_is_named_and_none_is_added(converted):
    entry, reference, model, x = converted
    found = audit_model(copy.deepcopy(model).float(), x.float())
    plain = audit_model(copy.deepcopy(reference).float().to(memory_format=torch.channels_last), x.float())
    assert found.breaks, f'{entry.name} has no break of its class: not a test of such breaks'
    assert all(b.module_path is not None for b in found.breaks), found
    assert len(found.breaks) <= len(plain.breaks), f'{entry.name}: {found} against plain channels last: {plain}'


def test_the_step_has_the_nchw_numbers(converted):
    entry, reference, model, x = converted
    params = [id(p) for p in model.parameters()]
    expected, actual = _step(reference, x.contiguous()), _step(model, x)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-10, atol=1e-12)
    for name, grad in expected[2].items():
        torch.testing.assert_close(actual[2][name], grad, rtol=1e-10, atol=1e-12, msg=name)
    assert [id(p) for p in model.parameters()] == params
    assert list(model.state_dict()) == list(reference.state_dict())


def test_graph_capture_sees_the_models_own_ops(converted):
    entry, reference, model, x = converted
    reference.eval(), model.eval()
    with torch.no_grad():
        expected = reference(x.contiguous())
        for name, capture in CAPTURES.items():
            try:
                original = capture(copy.deepcopy(reference), x.contiguous())
            except Exception:  # noqa: BLE001  (the original does not support it: nothing to keep)
                continue
            torch.testing.assert_close(original(x.contiguous()), expected, msg=f'{entry.name} {name}')
            graph = capture(copy.deepcopy(model), x)
            torch.testing.assert_close(graph(x), expected, msg=f'{entry.name} {name}')
