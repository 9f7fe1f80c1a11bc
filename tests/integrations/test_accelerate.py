"""The accelerate recipe (docs/integrations.md): convert before ``accelerator.prepare``, NHWC
batches from a LayoutGuard or from a forward pre-hook; it trains NHWC and as NCHW does."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip('accelerate', reason='the accelerate recipe needs accelerate (the newest-torch environment)')

from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from channels_last_algo import (
    LayoutGuard,
    batch_to_channels_last,
    has_channels_last_strides,
    is_channels_last,
    weight_layout_for,
)
from conftest import random_images

STEPS = 3


def small_net() -> nn.Module:
    """3x3 conv + BN, a depthwise 3x3 and a 1x1 (ambiguous strides), a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, groups=8),
        nn.Conv2d(8, 16, 1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


def loader() -> DataLoader:
    return DataLoader(TensorDataset(*random_images(n=4 * STEPS, size=12)), batch_size=4)


def train_nchw(net: nn.Module) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for images, labels in loader():
        nn.functional.cross_entropy(net(images), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize('batches', ['guard', 'forward_pre_hook'])
def test_accelerate_recipe_trains_nhwc_and_matches_nchw(double_precision, batches):
    torch.manual_seed(0)
    reference = small_net()
    net = small_net()
    net.load_state_dict(reference.state_dict())
    train_nchw(reference)

    # The recipe: convert first, then prepare; NHWC batches by the guard or by a pre-hook.
    accelerator = Accelerator(cpu=True)
    guard = LayoutGuard()
    fsdp = getattr(accelerator.state, 'fsdp_plugin', None)  # set only under FSDP
    guard.on_init(net, weight_layout=weight_layout_for(net, fsdp_config=fsdp))
    if batches == 'forward_pre_hook':
        net.register_forward_pre_hook(lambda module, args: batch_to_channels_last(args))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, train_loader = accelerator.prepare(net, optimizer, loader())

    inputs_nhwc, grads_nhwc = [], []
    net[0].register_forward_hook(lambda module, args, output: inputs_nhwc.append(is_channels_last(args[0])))
    for images, labels in train_loader:
        if batches == 'guard':
            images, labels = guard.on_batch((images, labels))
        accelerator.backward(nn.functional.cross_entropy(model(images), labels))
        grads_nhwc.append(all(has_channels_last_strides(p.grad) for p in net.parameters() if p.dim() == 4))
        optimizer.step()
        optimizer.zero_grad()

    assert inputs_nhwc == [True] * STEPS and grads_nhwc == [True] * STEPS
    assert all(has_channels_last_strides(p) for p in net.parameters() if p.dim() == 4)
    for (name, p), q in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, msg=name)
