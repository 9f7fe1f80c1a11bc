"""An optimizer's state and gradients keep their parameters' strides at every step: torch's fused CPU optimizers
walk memory in order, so NCHW state beside NHWC weights (a resumed plain loop, weights made contiguous by a late
view, a conversion after the first steps) would update the wrong elements, silently."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from guarded_runs import INTEGRATIONS, Run, assert_same_run, guarded, nchw
from torch import nn

from channels_last_algo.core.convert import apply_channels_last
from channels_last_algo.core.guard import LayoutGuard
from channels_last_algo.core.optimizer_state_layout import _before_step, match_state_to_weights

FUSED = {
    'adam': lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    'sgd': lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True),
}


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.Flatten(), nn.Linear(512, 5)
    )


def _batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.rand(4, 3, 8, 8, generator=generator, dtype=torch.float64),
            torch.randint(0, 5, (4,), generator=generator),
        )
        for _ in range(count)
    ]


def _train(net: nn.Module, optimizer: torch.optim.Optimizer, batches: list, guard: LayoutGuard | None = None) -> None:
    for images, labels in batches:
        optimizer.zero_grad()
        if guard is None:
            F.cross_entropy(net(images), labels).backward()
        else:
            images, labels = guard.on_batch((images, labels))
            with guard.step():
                F.cross_entropy(net(images), labels).backward()
        optimizer.step()


def _fresh() -> nn.Module:
    torch.manual_seed(0)
    return _net().double()


@pytest.mark.parametrize('optimizer', FUSED)
def test_a_plain_loop_resumed_from_an_nchw_checkpoint_trains_as_nchw_without_on_load(optimizer):
    batches = _batches(4)
    reference = _fresh()
    reference_optimizer = FUSED[optimizer](reference.parameters())
    _train(reference, reference_optimizer, batches[:2])
    saved = io.BytesIO()
    torch.save({'model': reference.state_dict(), 'optimizer': reference_optimizer.state_dict()}, saved)
    _train(reference, reference_optimizer, batches[2:])

    saved.seek(0)
    checkpoint = torch.load(saved)
    net, guard = _fresh(), LayoutGuard()
    guard.on_init(net)
    resumed = FUSED[optimizer](net.parameters())
    net.load_state_dict(checkpoint['model'])
    resumed.load_state_dict(checkpoint['optimizer'])  # NCHW state; no guard.on_load
    _train(net, resumed, batches[2:], guard)
    guard.close()
    assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
    for (name, mine), theirs in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=name)


class _LateWeightView(nn.Module):
    """From its third call the forward views a convolution's weight (a penalty by filter), which makes the
    weights contiguous after the optimizer took NHWC state."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
        self.head = nn.Linear(8, 5)
        self.calls = 0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.head(self.features(images).mean((2, 3)))
        if self.calls >= 3:
            out = out + 1e-3 * self.features[2].weight.view(8, -1).norm(dim=1).sum()
        return out


@pytest.mark.parametrize('integration', INTEGRATIONS)
@pytest.mark.parametrize('optimizer', FUSED)
def test_a_fused_optimizer_matches_nchw_when_a_late_view_makes_the_weights_contiguous(integration, optimizer):
    run = Run(
        build=_LateWeightView,
        batches=_batches(5),
        loss=lambda output, batch: F.cross_entropy(output, batch[1]),
        optimizer=FUSED[optimizer],
    )
    steps, net, _ = guarded(run, integration)
    assert net.features[2].weight.is_contiguous()
    assert_same_run(steps, nchw(run), f'{integration}, fused {optimizer}')


def test_a_conversion_after_the_first_steps_without_the_optimizer_matches_nchw():
    batches = _batches(3)
    reference, net = _fresh(), _fresh()
    reference_optimizer = FUSED['adam'](reference.parameters())
    optimizer = FUSED['adam'](net.parameters())
    _train(reference, reference_optimizer, batches)
    _train(net, optimizer, batches[:1])
    apply_channels_last(net)  # the Adam moments stay NCHW
    _train(net, optimizer, batches[1:])
    for (name, mine), theirs in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12, msg=name)


def test_state_that_views_a_shared_buffer_keeps_its_memory():
    weight = nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    optimizer = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    flat = torch.zeros(2 * weight.numel())
    optimizer.state[weight]['momentum_buffer'] = flat[: weight.numel()].view(4, 3, 2, 2)
    owned = torch.ones(4, 3, 2, 2)
    optimizer.state[weight]['owned'] = owned
    weight.grad = torch.ones(4, 3, 2, 2)

    assert match_state_to_weights(optimizer) == 2  # the gradient and the tensor of its own
    assert optimizer.state[weight]['momentum_buffer'].data_ptr() == flat.data_ptr()
    assert optimizer.state[weight]['owned'] is owned and owned.stride() == weight.stride()
    assert weight.grad.stride() == weight.stride() and torch.equal(weight.grad, torch.ones(4, 3, 2, 2))


def test_state_shared_with_other_processes_keeps_its_memory():
    """A3C's shared Adam: moments in shared memory that every worker steps; a restrided copy would be this
    process's alone."""
    weight = nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    shared = torch.zeros(4, 3, 2, 2).share_memory_()
    optimizer.state[weight]['exp_avg'] = shared

    assert match_state_to_weights(optimizer) == 0
    assert optimizer.state[weight]['exp_avg'] is shared and shared.is_shared() and shared.is_contiguous()


def test_nothing_is_restrided_once_no_converted_model_lives():
    """In a process of its own: the count of converted models alive is the process's."""
    program = (
        'import gc, torch\n'
        'from channels_last_algo.core.convert import apply_channels_last\n'
        'def state_after_step():\n'
        '    w = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))\n'
        '    w.grad = torch.zeros(4, 3, 2, 2).to(memory_format=torch.channels_last)\n'
        '    o = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)\n'
        '    o.state[w]["momentum_buffer"] = torch.zeros(4, 3, 2, 2)\n'
        '    o.step()\n'
        '    return o.state[w]["momentum_buffer"].is_contiguous()\n'
        'model = torch.nn.Conv2d(3, 4, 2)\n'
        'apply_channels_last(model)\n'
        'alive = state_after_step()\n'
        'del model; gc.collect()\n'
        'print(alive, state_after_step())\n'
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, '-c', program], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ['False', 'True']


def _per_sample_clipped_gradients(net: nn.Module) -> None:
    """DP-SGD as torch.func computes it: per-sample gradients, clipped, averaged, assigned to ``.grad`` (in the
    strides vmap gives them, not the weights')."""
    from torch.func import functional_call, grad, vmap

    images, labels = _per_sample_clipped_gradients.batch
    params = {name: p.detach() for name, p in net.named_parameters()}

    def loss(params, image, label):
        return F.cross_entropy(functional_call(net, params, (image[None],)), label[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, images, labels)
    norms = torch.stack([g.reshape(len(g), -1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    scale = 1.0 / (norms / 0.5).clamp(min=1.0)
    for name, p in net.named_parameters():
        p.grad = (per_sample[name] * scale.view(-1, *[1] * p.dim())).mean(0)


def test_gradients_a_loop_assigns_in_other_strides_are_stepped_as_in_nchw():
    def forward(net: nn.Module, batch: tuple) -> torch.Tensor:
        _per_sample_clipped_gradients.batch = batch
        return net(batch[0])

    run = Run(
        build=_net,
        batches=_batches(3),
        loss=lambda output, batch: F.cross_entropy(output, batch[1]),
        optimizer=FUSED['adam'],
        forward=forward,
        after_backward=_per_sample_clipped_gradients,
    )
    assert_same_run(guarded(run, 'guard')[0], nchw(run), 'DP-SGD, fused Adam')


def test_an_optimizer_no_weak_table_can_hold_is_matched_each_step():
    class Unhashable(torch.optim.SGD):
        __hash__ = None  # as a class defining __eq__ alone is

    conv = nn.Conv2d(3, 4, 2)
    apply_channels_last(conv)  # a converted model lives: the hook works
    optimizer = Unhashable(conv.parameters(), lr=0.1, momentum=0.9, fused=True)
    conv.weight.grad = torch.ones(4, 3, 2, 2)  # NCHW, assigned
    _before_step(optimizer, (optimizer,), {})
    assert conv.weight.grad.stride() == conv.weight.stride()


def test_a_group_added_later_is_matched_too():
    first = nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    added = nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    optimizer = torch.optim.SGD([first], lr=0.1, momentum=0.9, fused=True)
    first.grad = torch.ones(4, 3, 2, 2).to(memory_format=torch.channels_last)
    optimizer.step()
    optimizer.add_param_group({'params': [added]})  # as a fine-tuning schedule unfreezes a stage
    added.grad = torch.ones(4, 3, 2, 2)  # NCHW
    assert match_state_to_weights(optimizer) == 1
    assert added.grad.stride() == added.stride()
