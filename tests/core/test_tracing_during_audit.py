"""A guarded model compiles (``fullgraph=True``), traces and exports as the plain model does, also while
an audit is in progress (whose dispatch mode torch.compile refuses to trace under)."""

from __future__ import annotations

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn

from channels_last_algo.core.guard import LayoutGuard


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 10, 10, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('how', ['wrapper', 'in_place'])
def test_fullgraph_compile_while_audited_matches_eager(how):
    net, reference = _net(), _net()
    guard = LayoutGuard(audit_steps=2)
    guard.on_init(net)
    if how == 'wrapper':
        run = torch.compile(net, fullgraph=True, backend='aot_eager')
    else:
        net.compile(fullgraph=True, backend='aot_eager')
        run = net
    for _ in range(3):
        images = _images()
        with guard.step():
            out = run(guard.on_batch(images))
            out.sum().backward()
        torch.testing.assert_close(out, reference(images))
    assert guard.report.steps == 2


def test_trace_and_export_while_audited():
    net = _net()
    guard = LayoutGuard(audit_steps=1)
    guard.on_init(net)
    images = guard.on_batch(_images())
    with guard.step():
        traced = torch.jit.trace(net, images)
        exported = torch.export.export(net, (images,))
        net(images).sum().backward()
    torch.testing.assert_close(traced(images), net(images))
    torch.testing.assert_close(exported.module()(images), net(images))
    assert guard.report.steps == 1


def _fullgraph_forward(net: nn.Module, batch: tuple) -> torch.Tensor:
    """``net`` compiled once with ``fullgraph=True`` (kept outside its modules), run on the images."""
    compiled = net.__dict__.get('_fullgraph')
    if compiled is None:
        compiled = net.__dict__['_fullgraph'] = torch.compile(net, fullgraph=True, backend='aot_eager')
    return compiled(batch[0])


@pytest.mark.parametrize('integration', INTEGRATIONS)
def test_fullgraph_compile_in_each_integration_while_audited(integration):
    torch._dynamo.reset()  # fullgraph: one recompile past the limit fails; torch.nn modules share their traced code
    generator = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(2, 3, 10, 10, generator=generator, dtype=torch.float64), torch.randint(0, 4, (2,)))
        for _ in range(3)
    ]
    run = Run(_net, batches, lambda out, batch: nn.functional.cross_entropy(out, batch[1]), forward=_fullgraph_forward)
    steps, _, owner = guarded(run, integration, audit_steps=2)
    assert_same_run(steps, nchw(run), f'compile(fullgraph=True) through {integration}')
    assert owner.report.steps == 2
