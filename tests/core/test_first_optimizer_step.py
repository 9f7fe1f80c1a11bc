"""An optimizer of the user's that flattens weights, gradients or its state, and code between the
backward and the optimizer step that flattens the gradients, train as in NCHW.

No known-optimizer row names these: the first step of an optimizer whose ``step`` is not torch's own
runs under a view watch, the first training step's watch lasts until the optimizer steps, and the
first flattening use makes the weights contiguous on the spot. Each trains 3 float64 steps through
LayoutGuard, the Composer algorithm and the Lightning callback (whose optimizer step runs the
forward and backward in a closure), equal to the NCHW run on every step.
"""

from __future__ import annotations

import logging

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, classification_batches, guarded, nchw
from torch import nn
from torch.nn import functional as F

from channels_last_algo.core.guard import LayoutGuard


def _closure_first(closure):
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FilterNormalised(torch.optim.SGD):
    """SGD on gradients normalised per filter through ``p.grad.view(out_channels, -1)``, in place."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_first(closure)
        for p in self.param_groups[0]['params']:
            if p.grad is not None and p.ndim == 4:
                rows = p.grad.view(len(p), -1)
                rows.div_(rows.norm(dim=1, keepdim=True) + 1.0)
        super().step()
        return loss


class _PerParameter(torch.optim.Optimizer):
    """A user's optimizer: the closure first, then ``update(p, lr)`` for each parameter with a gradient."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_first(closure)
        for group in self.param_groups:
            for p in group['params']:
                if p.grad is not None:
                    self.update(p, group['lr'])
        return loss


class TrustRatio(_PerParameter):
    """A LARS-style step: the trust ratio from ``p.view(-1)`` and ``p.grad.view(-1)``."""

    def update(self, p, lr):
        trust = p.view(-1).norm() / (p.grad.view(-1).norm() + 1e-6)
        p.add_(p.grad, alpha=-lr * float(trust.clamp(max=1.0)))


class MomentumRowsClipped(_PerParameter):
    """Momentum whose buffer is clipped per filter through ``buf.reshape(out_channels, -1)``, in place:
    a view of the buffer in NCHW, a copy of an NHWC one."""

    def update(self, p, lr):
        buf = self.state[p].setdefault('momentum_buffer', torch.zeros_like(p))
        buf.mul_(0.9).add_(p.grad)
        rows = buf.reshape(len(p), -1)
        rows.mul_(0.5 / rows.norm(dim=1, keepdim=True).clamp(min=0.5))
        p.add_(buf, alpha=-lr)


def _network() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10)
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return classification_batches(classes=10, seed=2)


def _cross_entropy(output, batch):
    return F.cross_entropy(output, batch[1])


OPTIMIZERS = {
    'filter-normalised': (FilterNormalised, dict(lr=0.1, momentum=0.9), "a weight's gradient is viewed at"),
    'trust-ratio': (TrustRatio, {}, 'a weight is viewed at'),
    'momentum-rows-clipped': (MomentumRowsClipped, {}, 'through the .reshape() at'),
}


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('name', list(OPTIMIZERS))
def test_a_flattening_optimizer_of_the_users_trains_as_in_nchw(name, integration, caplog):
    """Every step equals NCHW's; the weights are contiguous after the first step, and one console line
    names the optimizer's step and the line that flattened."""
    optimizer, options, what = OPTIMIZERS[name]
    run = Run(_network, _batches(), _cross_entropy, lambda params: optimizer(params, **options))
    with caplog.at_level(logging.INFO):  # the guard's logger, or Lightning's console
        steps, net, owner = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'{name} through {integration}')
    guard = owner if isinstance(owner, LayoutGuard) else owner.guard
    assert guard.weight_layout.contiguous and all(p.is_contiguous() for p in net.parameters())
    said = [r.getMessage() for r in caplog.records if 'weights contiguous, activations NHWC (' in r.getMessage()]
    assert len(said) == 1 and f'{optimizer.__name__}.step: ' in said[0] and what in said[0], said
    assert 'test_first_optimizer_step.py:' in said[0]


def _gradient_norm_logged_and_filters_normalised(net: nn.Module) -> None:
    """What training loops do between the backward and the step: the gradient norm from
    ``torch.cat([p.grad.view(-1) ...])``, then each filter's gradient normalised through ``.view()``."""
    norm = torch.cat([p.grad.view(-1) for p in net.parameters()]).norm()
    for p in net.parameters():
        if p.ndim == 4:
            rows = p.grad.view(len(p), -1)
            rows.div_(rows.norm(dim=1, keepdim=True) + norm)


@pytest.mark.parametrize('integration', INTEGRATIONS)
def test_gradients_flattened_between_the_backward_and_the_step_train_as_in_nchw(integration, caplog):
    """Composer's ``AFTER_BACKWARD`` callbacks, Lightning's ``on_before_optimizer_step`` and a plain
    loop's code after the backward inside ``guard.step()`` flatten the gradients; SGD steps. The
    trainers' first step's watch lasts until the optimizer steps: the weights go contiguous there, said once."""
    run = Run(_network, _batches(), _cross_entropy, after_backward=_gradient_norm_logged_and_filters_normalised)
    with caplog.at_level(logging.INFO):
        steps, net, owner = guarded(run, integration)
    assert_same_run(steps, nchw(run), f'gradients flattened after the backward through {integration}')
    guard = owner if isinstance(owner, LayoutGuard) else owner.guard
    assert guard.weight_layout.contiguous and all(p.is_contiguous() for p in net.parameters())
    said = [r.getMessage() for r in caplog.records if 'weights contiguous, activations NHWC (' in r.getMessage()]
    assert len(said) == 1 and "(a weight's gradient is viewed at " in said[0], said


def test_the_first_steps_watch_lasts_until_a_trainers_optimizer_step_and_no_longer():
    """Where an optimizer step follows (a trainer's ``on_step_end(until_optimizer_step=True)``), the first
    training step's watch ends with it, also when nothing was viewed; a plain loop's ``guard.step()``
    leaves nothing on after its block."""
    net = _network().double()
    guard = LayoutGuard()
    guard.on_init(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    images, labels = guard.on_batch(_batches()[0])
    guard.on_step_start()
    _cross_entropy(net(images), (images, labels)).backward()
    guard.on_step_end(until_optimizer_step=True)
    assert torch._C._len_torch_function_stack() == 1  # the first step's watch, lasting
    optimizer.step()
    assert torch._C._len_torch_function_stack() == 0 and not net[0].weight.is_contiguous()
    guard.close()

    guard = LayoutGuard()
    guard.on_init(net)
    with guard.step():
        _cross_entropy(net(guard.on_batch(images)), (images, labels)).backward()
    assert torch._C._len_torch_function_stack() == 0
    guard.close()


@pytest.mark.parametrize('name', ['filter-normalised', 'momentum-rows-clipped'])
def test_an_optimizer_stepped_inside_the_guards_step_is_watched_by_its_own_watch(name, caplog):
    """``optimizer.step()`` inside ``with guard.step():`` runs under both watches: the one over the first
    optimizer step, entered last, takes the gradient's view or the state's reshape, and the step's own
    watch leaves them alone (it would keep every later step watched)."""
    optimizer_class, options, what = OPTIMIZERS[name]
    batches = _batches()
    expected = nchw(Run(_network, batches, _cross_entropy, lambda params: optimizer_class(params, **options)))
    torch.manual_seed(0)
    net = _network().double()
    guard = LayoutGuard()
    guard.on_init(net)
    optimizer = optimizer_class(net.parameters(), **options)
    with caplog.at_level(logging.WARNING, logger='channels_last_algo.core.guard'):
        for batch, (expected_loss, _) in zip(batches, expected):
            images, labels = guard.on_batch(batch)
            with guard.step():
                optimizer.zero_grad()
                loss = _cross_entropy(net(images), (images, labels))
                loss.backward()
                optimizer.step()
            torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-10)
    guard.close()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f'{optimizer_class.__name__}.step: ' in said[0] and what in said[0], said


def test_torch_optimizers_and_steps_that_do_not_flatten_keep_the_weights_channels_last():
    """SGD is torch's own and never watched; a step of the user's that flattens nothing is watched
    once and changes nothing."""

    for optimizer in (torch.optim.SGD, _Clipped):
        run = Run(_network, _batches(), _cross_entropy, lambda params, optimizer=optimizer: optimizer(params, lr=0.1))
        steps, net, guard = guarded(run, 'guard')
        assert_same_run(steps, nchw(run), optimizer.__name__)
        assert not guard.weight_layout.contiguous and not net[0].weight.is_contiguous()


class _Clipped(torch.optim.SGD):
    def step(self, closure=None):
        torch.nn.utils.clip_grad_norm_(self.param_groups[0]['params'], 1.0)
        return super().step(closure)


@pytest.mark.parametrize('optimizer_class', [torch.optim.SGD, _Clipped])
def test_a_compiled_optimizer_step_is_left_to_the_compiler(optimizer_class):
    """``torch.compile(optimizer.step)`` under the first step's lasting watch: no watch enters its graph
    (a mode there fails dynamo's tracing of some steps), and the run equals NCHW's."""
    batches = _batches()
    expected = nchw(Run(_network, batches, _cross_entropy, lambda params: optimizer_class(params, lr=0.1)))
    torch.manual_seed(0)
    net = _network().double()
    guard = LayoutGuard()
    guard.on_init(net)
    optimizer = optimizer_class(net.parameters(), lr=0.1)
    step = torch.compile(optimizer.step, backend='eager')
    for batch, (expected_loss, _) in zip(batches, expected):
        images, labels = guard.on_batch(batch)
        guard.on_step_start()
        optimizer.zero_grad()
        loss = _cross_entropy(net(images), (images, labels))
        loss.backward()
        guard.on_step_end(until_optimizer_step=True)
        step()
        torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dict(net.named_parameters()), expected[-1][1], rtol=1e-10, atol=1e-10)
    guard.close()
    assert torch._C._len_torch_function_stack() == 0


class _FailsOnce(torch.optim.SGD):
    def step(self, closure=None):
        if not getattr(self, 'failed', False):
            self.failed = True
            raise ValueError('a step that fails')
        return super().step(closure)


def test_an_optimizer_stepped_inside_anothers_closure_leaves_no_watch_on():
    """Two user optimizers' first steps, one inside the other's closure: each watch ends with its step."""
    net = _network().double()
    guard = LayoutGuard()
    guard.on_init(net)
    parameters = list(net.parameters())
    outer, inner = FilterNormalised(parameters[:-2], lr=0.1), TrustRatio(parameters[-2:])
    images, labels = guard.on_batch(_batches()[0])

    def closure():
        outer.zero_grad()
        inner.zero_grad()
        with guard.step():
            loss = _cross_entropy(net(images), (images, labels))
            loss.backward()
        inner.step()
        return loss

    outer.step(closure)
    assert torch._C._len_torch_function_stack() == 0
    guard.close()


@pytest.mark.parametrize('ended_by', ['the next step', 'close'])
def test_a_first_step_that_raises_leaves_no_watch_on(ended_by):
    """The watches over a first optimizer step that raised come off at the next step, or at ``close``."""
    net = _network().double()
    guard = LayoutGuard()
    guard.on_init(net)
    optimizer = _FailsOnce(net.parameters(), lr=0.1)
    images, labels = guard.on_batch(_batches()[0])
    with guard.step():
        _cross_entropy(net(images), (images, labels)).backward()
    with pytest.raises(ValueError, match='a step that fails'):
        optimizer.step()
    assert torch._C._len_torch_function_stack() == 1  # the optimizer step's, left on by the error
    if ended_by == 'the next step':
        optimizer.step()
        assert torch._C._len_torch_function_stack() == 0
    guard.close()
    assert torch._C._len_torch_function_stack() == 0
