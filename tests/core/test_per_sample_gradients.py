"""Differentially private training, as torch and Opacus compute per-sample gradients, trains under the package as in
NCHW.

torch's expanded weights (``call_for_per_sample_grads``, Opacus's ``grad_sample_mode='ew'``) put an ``ExpandedWeight``
in each layer's weights: a tensor subclass whose ``__torch_function__`` refuses every op but a layer's own (no
strides, no ``grad_fn``), and whose autograd Functions ``.view()`` the gradients they are given, which plain channels
last makes NHWC ("view size is not compatible"). Opacus's optimizer wraps the user's without running
``Optimizer.__init__``: it takes no step hooks. BackPACK's and Opacus's hooks look each layer's handling up by
its exact class, which a repair changes: such a layer keeps its class. Each run trains 3 float64 steps through
every integration (with expanded weights clipping each sample's gradient to norm 1 as DP-SGD does), each step
equal to the NCHW run's.
"""

from __future__ import annotations

import pytest
import torch
from guarded_runs import INTEGRATIONS, Run, assert_same_run, classification_batches, guarded, nchw
from torch import nn
from torch.nn import functional as F
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

from channels_last_algo.core.layout import readable, unreadable_among


def _stack() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip


def _per_sample_forward(net: nn.Module, batch: tuple) -> torch.Tensor:
    return call_for_per_sample_grads(net)(batch[0])


def _summed_loss(output: torch.Tensor, batch: tuple) -> torch.Tensor:
    return F.cross_entropy(output, batch[1], reduction='sum')


def _clip_per_sample(net: nn.Module) -> None:
    """DP-SGD's clip: each sample's gradient (over every parameter) scaled to norm 1 at most, then summed."""
    params = [p for p in net.parameters() if p.requires_grad]
    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params]).norm(dim=0)
    factors = (1.0 / norms).clamp(max=1.0)
    for p in params:
        p.grad, p.grad_sample = torch.einsum('n,n...->...', factors, p.grad_sample), None


class WrappedOptimizer(torch.optim.Optimizer):
    """Steps the optimizer it wraps, sharing its groups and state, without running ``Optimizer.__init__``."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner, self.param_groups, self.state, self.defaults = inner, inner.param_groups, inner.state, {}

    def step(self, closure=None):
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)


class TypeDispatchedHooks:
    """A forward and a backward hook on every layer that look their handling up by ``type(module)``, as BackPACK's
    and Opacus's hooks do (a class they do not know raises KeyError): the forward one changes the output, the
    backward one checks the layer is known."""

    TABLE = {
        nn.AdaptiveAvgPool2d: lambda output: output * 2,
        nn.GroupNorm: lambda output: output + 0.1,
        **{kind: lambda output: output for kind in (nn.Conv2d, nn.ReLU, nn.Flatten, nn.Linear, nn.Sequential)},
    }

    def __init__(self, net: nn.Module) -> None:
        for module in net.modules():
            module.register_forward_hook(self._dispatched)
            module.register_full_backward_hook(
                lambda module, grad_input, grad_output: self.TABLE[type(module)] and None
            )

    def _dispatched(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return self.TABLE[type(module)](output)


def _hooked_stack() -> nn.Module:
    net = _stack()
    TypeDispatchedHooks(net)
    return net


RUNS = {
    'expanded-weights': Run(
        _stack, classification_batches((4, 3, 9, 9)), _summed_loss,
        forward=_per_sample_forward, after_backward=_clip_per_sample,
    ),
    'type-dispatched-hooks': Run(_hooked_stack, classification_batches((4, 3, 9, 9)), _summed_loss),
    'wrapped-optimizer': Run(
        _stack, classification_batches((4, 3, 9, 9)), _summed_loss,
        optimizer=lambda params: WrappedOptimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9)),
    ),
}  # fmt: skip


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('name', list(RUNS))
def test_per_sample_gradient_training_runs_as_in_nchw(name, integration):
    steps, net, _ = guarded(RUNS[name], integration)
    assert_same_run(steps, nchw(RUNS[name]), f'{name} through {integration}')
    assert not net[2].weight.is_contiguous(), 'the convolutions should be channels last'


def test_plain_channels_last_fails_on_expanded_weights():
    """The case the package covers: plain channels last raises in an expanded weight's backward."""
    net = _stack().double().to(memory_format=torch.channels_last)
    images = torch.randn(4, 3, 9, 9, dtype=torch.float64).to(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match='view size is not compatible'):
        call_for_per_sample_grads(net)(images).sum().backward()


def test_an_expanded_weight_is_unreadable_and_a_plain_tensor_is_readable():
    from torch.nn.utils._expanded_weights.expanded_weights_impl import ExpandedWeight

    weight = ExpandedWeight(torch.zeros(4, 3, 1, 1, requires_grad=True), 2, 'sum')
    assert not readable(weight) and readable(torch.zeros(1))
    assert unreadable_among((ExpandedWeight,), ([torch.zeros(1), weight],))
    assert not unreadable_among((torch.Tensor,), (torch.zeros(1),))
